"""Shell entry points parse (bash -n), and the README's first commands are the real ones."""

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
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
    assert "./scripts/bootstrap.sh && .venv/bin/vllm-fp4-moe demo" in head
    assert "./scripts/test.sh" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/test.sh" in ci
    test_sh = (ROOT / "scripts" / "test.sh").read_text()
    for step in ("./scripts/bootstrap.sh --with-engine", "./scripts/bootstrap-release.sh",
                 ".venv/bin/python -m pytest", "VLLM_FP4_MOE_EXPECT_DESIGN=0.11.1",
                 "tests/upstream"):
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
