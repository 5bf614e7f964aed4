# SPDX-License-Identifier: Apache-2.0
"""`python -m benchmarks.run --smoke --worlds here` runs in the vLLM 0.11.0 world
and its structural targets hold. (The 0.34.0 world's smoke test is tests/nvfp4_oracle's.)

Timing targets are not asserted tightly (CI machines are noisy); only loose sanity bounds.
"""

import json
import math
import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
TP_LIKE = ("single", "tp")
DP = ("dp_ep_allgather",)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "smoke.json"
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--smoke", "--worlds", "here",
                           "--json", str(out), "--gpu-json", str(out.parent / "no-gpu.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "rows," in proc.stdout and "| status" in proc.stdout
    worlds = json.loads(out.read_text())["worlds"]
    assert list(worlds) == [f"vllm-{version('vllm')}"]  # this world only, under its name
    return next(iter(worlds.values()))


def _rows(report, item, contains=""):
    return [r for r in report["rows"] if r["item"] == item and contains in r["name"]]


def _one(report, item, contains):
    rows = _rows(report, item, contains)
    assert len(rows) == 1, (item, contains, [r["name"] for r in rows])
    return rows[0]


def test_every_item_present_and_finite(report):
    for item in range(1, 8):
        assert _rows(report, item), f"no rows for item {item}"
    for r in report["rows"]:
        assert r["status"] in ("ok", "MISSED", "info")
        values = [r["baseline"]] if r["item"] == 7 else [r["plugin"]]  # item 7: GPU not run
        if r["baseline"] is not None:
            values.append(r["baseline"])
        for v in values:
            assert v is not None and math.isfinite(v), r


def test_item3_no_pre_kernel_quantization_in_tp_layouts(report):
    for layout in TP_LIKE:
        r = _one(report, 3, f"quant passes, {layout}")
        assert (r["plugin"], r["baseline"]) == (0, 1), r
        assert _one(report, 3, f"activation bytes, {layout}")["plugin"] == 0
    for layout in DP:
        r = _one(report, 3, f"quant passes, {layout}")
        assert r["plugin"] == r["baseline"] == 1, r


def test_item4_plugin_error_at_most_upstream_and_far_below_stock(report):
    upstream = [r for r in _rows(report, 4) if r["baseline_name"].startswith("upstream")
                and "seeds" not in r["name"]]
    assert {s for r in upstream for s in ("1.5x", "4x") if s in r["name"]} == {"1.5x", "4x"}
    for r in upstream:
        assert r["plugin"] <= r["baseline"] * (1 + 1e-3), r
        # vs fp32 both carry NVFP4's own noise (~0.15); stock's mismatch comes on top of it
        assert r["extra"]["stock"] > (3 if "4x" in r["name"] else 1.3) * r["plugin"], r
    # No strict "plugin < upstream" here: over other seeds the sign flips in some cases (the
    # seed-sweep row shows it), so asserting it would pin a property of one fixture.
    sweep = _one(report, 4, "seeds")
    assert 0 <= sweep["extra"]["plugin_lower_in"] <= sweep["extra"]["cases"]


def test_item2_times_each_layer_on_its_own_path(report):
    for r in _rows(report, 2):
        assert r["extra"]["pre_kernel_passes"] == {"stock": 1, "plugin": 0, "stock#2": 1}, r


def test_loose_timing_sanity(report):
    assert _one(report, 1, "VLLM_FP4_MOE_PLUGIN=1")["plugin"] < 200  # ms; target 10
    assert _one(report, 5, "audit")["plugin"] < 60  # s; target 5
    assert _one(report, 6, "total")["plugin"] < 10_000  # ms; target 1000
    assert _one(report, 6, "load-time check")["extra"]["all_layers_consistent"]
