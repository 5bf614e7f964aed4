# SPDX-License-Identifier: Apache-2.0
"""Shell entry points parse (bash -n), and the README's first commands are the real ones."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*ROOT.glob("examples/*.sh"), *ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_eval_script_rejects_unknown_layout():
    r = subprocess.run(["bash", str(ROOT / "examples" / "eval_gsm8k.sh")], capture_output=True,
                       text=True, env={"LAYOUT": "tp3", "PATH": "/usr/bin:/bin", "OUT": "/tmp"})
    assert r.returncode == 2 and "LAYOUT must be" in r.stderr


def test_readme_opens_with_demo_and_test_commands():
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")] if "## " in text else text
    assert "./scripts/bootstrap.sh && .venv/bin/vllm-fp4-moe-lab demo" in head
    assert "./scripts/test.sh" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test.sh" in ci
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    for step in ("./scripts/bootstrap.sh", "./scripts/bootstrap-engine.sh",
                 "./scripts/bootstrap-engine.sh 0.32.0", "./scripts/bootstrap-release.sh",
                 ".venv/bin/python -m pytest", "VLLM_FP4_MOE_EXPECT_DESIGN=modular_method",
                 "tests/modular_method", "./scripts/bootstrap-release.sh 0.34.0",
                 "VLLM_FP4_MOE_EXPECT_DESIGN=nvfp4_oracle", "tests/nvfp4_oracle"):
        assert step in test_sh


@pytest.mark.parametrize("layout,expect", [("tp4_ep", "--tensor-parallel-size 4"),
                                           ("dp4_ep", "--data-parallel-size 4"),
                                           ("pp2", "--pipeline-parallel-size 2")])
def test_serve_script_dry_run(layout, expect):
    r = subprocess.run(["bash", str(ROOT / "examples" / "serve_deepseek_r1_fp4.sh")],
                       capture_output=True, text=True,
                       env={"LAYOUT": layout, "DRY_RUN": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert expect in r.stdout and "VLLM_FP4_MOE_PLUGIN=1" in r.stdout


def test_offline_example_dry_run():
    import sys

    r = subprocess.run([sys.executable, str(ROOT / "examples" / "offline_generate.py"),
                        "--dry-run", "--ep"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "'enable_expert_parallel': True" in r.stdout and "'VLLM_FP4_MOE_PLUGIN': '1'" in r.stdout


def _dedupe(*roots):
    import sys

    return subprocess.run([sys.executable, str(ROOT / "scripts" / "dedupe_venvs.py"),
                           *map(str, roots)], capture_output=True, text=True, check=True)


def test_dedupe_links_only_true_twins(tmp_path):
    a, b = tmp_path / "a" / "lib", tmp_path / "b" / "lib"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    payload = bytes(range(256)) * 1024  # 256 KiB, above the size floor
    for d in (a, b):
        (d / "same.so").write_bytes(payload)
        (d / "mode.so").write_bytes(payload)
    (a / "differs.so").write_bytes(payload)
    (b / "differs.so").write_bytes(payload[:-1] + b"\x00")  # same size, one byte off
    (b / "only_here.so").write_bytes(payload)
    (a / "small.py").write_bytes(b"x = 1\n")
    (b / "small.py").write_bytes(b"x = 1\n")
    (b / "mode.so").chmod(0o755)
    (a / "mode.so").chmod(0o644)

    out = _dedupe(tmp_path / "a", tmp_path / "b").stdout
    assert "1 files linked" in out
    assert (a / "same.so").stat().st_ino == (b / "same.so").stat().st_ino
    for name in ("differs.so", "mode.so", "small.py"):
        assert (a / name).stat().st_ino != (b / name).stat().st_ino, name
    assert (b / "differs.so").read_bytes()[-1] == 0 and (b / "same.so").read_bytes() == payload
    assert "0 files linked" in _dedupe(tmp_path / "a", tmp_path / "b").stdout  # idempotent


def test_disk_check_names_what_to_free(tmp_path):
    r = subprocess.run(["bash", "-c",
                        '. scripts/disk.sh; require_free_gib 100000000 "installing X"'],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 1
    assert "installing X needs ~100000000 GiB free" in r.stderr and "rm -rf .venv-*" in r.stderr
    assert not list(ROOT.glob(".pip-tmp.*"))  # its temporary directory is gone with it


@pytest.mark.parametrize("layout,expect", [("dp4_ep", "--data-parallel-size 4"),
                                           ("tp4_ep", "--tensor-parallel-size 4")])
def test_eval_script_dry_run(layout, expect):
    """The Blackwell confirmation on the newest release: stock then plugin, same serve command,
    a compressed-tensors NVFP4 MoE checkpoint, vLLM's default backend and dispatch."""
    r = subprocess.run(["bash", str(ROOT / "examples" / "eval_gsm8k_newest.sh")],
                       capture_output=True, text=True,
                       env={"LAYOUT": layout, "DRY_RUN": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    serves = [line for line in r.stdout.splitlines() if " vllm serve " in line]
    assert [("VLLM_FP4_MOE_PLUGIN=0" in s, "VLLM_FP4_MOE_PLUGIN=1" in s) for s in serves] == [
        (True, False), (False, True)]
    assert all(expect in s and "--enable-expert-parallel" in s and "NVFP4" in s for s in serves)
    assert r.stdout.count("lm_eval") == 2 and "gsm8k" in r.stdout


def test_eval_newest_script_rejects_unknown_layout():
    r = subprocess.run(["bash", str(ROOT / "examples" / "eval_gsm8k_newest.sh")],
                       capture_output=True, text=True,
                       env={"LAYOUT": "dp3", "PATH": "/usr/bin:/bin", "OUT": "/tmp"})
    assert r.returncode == 2 and "LAYOUT must be" in r.stderr
