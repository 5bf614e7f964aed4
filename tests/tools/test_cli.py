# SPDX-License-Identifier: Apache-2.0
"""The console scripts' subcommands (vllm-fp4-moe, vllm-fp4-moe-lab), as a user calls them
(exit codes, --json keys)."""

import json
import subprocess
import sys

import pytest

LAB_COMMANDS = ("matrix", "make-checkpoint", "demo")  # vllm-fp4-moe-lab's; the rest are served


def cli(*args, timeout=600):
    module = "fp4_moe_lab.cli" if args[0] in LAB_COMMANDS else "vllm_fp4_moe_plugin.tools.cli"
    return subprocess.run([sys.executable, "-m", module, *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def spread_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ck") / "spread"
    r = cli("make-checkpoint", str(out), "--format", "compressed-tensors", "--json")
    assert r.returncode == 0, r.stderr
    return out, json.loads(r.stdout)


def test_audit_flags_a_spread_checkpoint(spread_checkpoint):
    path, manifest = spread_checkpoint
    r = cli("audit", str(path), "--json")
    assert r.returncode == 1, r.stderr  # 1 = affected
    report = json.loads(r.stdout)
    assert report["format"] == "compressed-tensors"
    assert report["affected_layers"] == len(manifest["layers"]) > 0
    for layer in report["layers"]:
        assert layer["w13_spread"] == pytest.approx(4.0)
        assert all(layer["affected"].values())


def test_audit_passes_a_uniform_checkpoint(tmp_path):
    out = tmp_path / "uniform"
    assert cli("make-checkpoint", str(out), "--spread", "1").returncode == 0
    r = cli("audit", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "affected layers: 0" in r.stdout


def test_audit_error_is_clear(tmp_path):
    r = cli("audit", str(tmp_path / "missing"))
    assert r.returncode == 2 and "missing" in r.stderr


def test_demo_without_engine(tmp_path):
    r = cli("demo", "--out", str(tmp_path), "--no-engine", timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for text in ("== 1.", "== 2.", "AFFECTED", "== 3.", "RESULT: the plugin reproduces"):
        assert text in r.stdout
    assert "instead of a whole engine: --no-engine" in r.stdout  # says why, in one line
