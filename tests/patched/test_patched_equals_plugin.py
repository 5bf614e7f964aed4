# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34.0 with every patch computes, with the plugin off, what stock 0.34.0 computes with
the plugin on: the same layers (real vLLM code in real gloo ranks; SM100 and FlashInfer
simulated as in tests/nvfp4_oracle), the same seeds, the errors equal to the last bit.

Rows where stock 0.34.0 is wrong (compressed-tensors under DP+EP, uncalibrated experts, vLLM's
own CUTLASS kernel under DP+EP) are among those compared; elsewhere stock, patched and the
plugin agree. The planted ``missing`` case hands stock vLLM the value the memory held in the one
engine run that showed it (simulation/planted_scales.py) where the plugin loads no tensor; the
patch's own test (upstream/0002) shows that a missing scale stays NaN in the patched loader.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.patched.conftest import FIXES, REPAIR_OPT_IN

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# The layouts that show the EP hole (the default dispatch, FlashInfer's one-sided NVLink) and
# one where stock is right (TP+EP: no dispatch); docs/UPSTREAM.md has the full matrix.
MATRIX_LAYOUTS = ("tp_ep", "dp_ep_allgather", "dp_ep_one_sided")
UNCALIBRATED = ("from fp4_moe_lab.simulation.uncalibrated import run_uncalibrated\n"
                "from tests.uncalibrated_checks import CI_PLANTS, LAYOUTS\n"
                "import json, sys\n"
                "json.dump(run_uncalibrated(LAYOUTS, CI_PLANTS), open(sys.argv[1], 'w'))\n")


def _run(python: str, *args: str, env=None) -> subprocess.CompletedProcess:
    r = subprocess.run([python, *args], capture_output=True, text=True, cwd=ROOT, timeout=1800,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _matrix(python: str, *args: str) -> dict:
    """The matrix rows of ``args`` (default: :data:`MATRIX_LAYOUTS`, the default backends)."""
    args = args or tuple(a for layout in MATRIX_LAYOUTS for a in ("--layout", layout))
    rows = json.loads(_run(python, "-m", "fp4_moe_lab.cli", "matrix", "--json", *args).stdout)
    return {(r["format"], r["layout"], r["backend"]): r for r in rows}


def _uncalibrated(python: str, tmp_path: Path, env=None) -> dict:
    out = tmp_path / f"rows-{abs(hash(python))}.json"
    _run(python, "-c", UNCALIBRATED, str(out), env=env)
    return {(r["format"], r["layout"], r["gemm"], r["case"]): r
            for r in json.loads(out.read_text())}


def _same_plugin_answers(patched: dict, stock: dict) -> None:
    """The plugin gives the same answers in both worlds (by its own reference and fp32 where
    the reference differs: see :func:`_same_answers`)."""
    assert patched.keys() == stock.keys() and stock
    for key, s in stock.items():
        p = patched[key]
        assert p["plugin_error"] is None and s["plugin_error"] is None, (key, p, s)
        if p["reference_scheme"] == s["reference_scheme"]:
            assert (p["plugin_rel_err"], p["plugin_fp32_err"]) == \
                (s["plugin_rel_err"], s["plugin_fp32_err"]), (key, p, s)
        else:
            assert p["ok"] and s["ok"], (key, p, s)
            assert p["plugin_fp32_err"] == pytest.approx(s["plugin_fp32_err"], rel=0.05), key


def _same_answers(patched: dict, stock: dict) -> None:
    """Patched stock == stock 0.34.0 with the plugin, and the plugin, standing down in the
    patched world, == patched stock; stock 0.34.0 is wrong in some of the rows compared.

    One exception, by design: compressed-tensors under EP with every expert's input scales
    loaded (upstream/0001) collapses GEMM2's scale over all experts, as ModelOpt does, where the
    plugin on stock keeps each rank's own (GEMM2 is quantized where it is dequantized). Both are
    consistent: each row sits at its own reference, equally far from the fp32 layer."""
    assert patched.keys() == stock.keys() and stock
    for key, s in stock.items():
        p = patched[key]
        assert p["stock_error"] is None and s["plugin_error"] is None, key
        assert p["bit_identical"], key
        if p["reference_scheme"] == s["reference_scheme"]:
            assert (p["stock_rel_err"], p["stock_fp32_err"]) == \
                (s["plugin_rel_err"], s["plugin_fp32_err"]), (key, p, s)
            continue
        assert key[0] == "compressed-tensors" and "ep" in key[1], (key, p, s)
        assert p["ok"] and s["ok"], (key, p, s)
        assert p["stock_fp32_err"] == pytest.approx(s["plugin_fp32_err"], rel=0.05), (key, p, s)
    assert any(not s["bit_identical"] for s in stock.values())


def test_matrix_patched_stock_equals_plugin(fixed, stock_python):
    if fixed != FIXES["all"]:
        pytest.fail("run this module in the world with every patch (VLLM_FP4_MOE_PATCHED=all)")
    _same_answers(_matrix(sys.executable), _matrix(stock_python))


def test_vllm_cutlass_patched_stock_equals_plugin(fixed, stock_python):
    """vLLM's own CUTLASS kernel under DP+EP (stock reads the workspace for non-local routes)."""
    if "upstream_zeroes_non_local_routes" not in fixed:
        pytest.fail("run this module in the world with every patch (VLLM_FP4_MOE_PATCHED=all)")
    args = ("--backend", "vllm_cutlass", "--layout", "dp_ep_allgather")
    _same_answers(_matrix(sys.executable, *args), _matrix(stock_python, *args))


def test_uncalibrated_patched_stock_equals_plugin(fixed, stock_python, tmp_path):
    if "upstream_repairs_uncalibrated" not in fixed:
        pytest.fail("run this module in the world with every patch (VLLM_FP4_MOE_PATCHED=all)")
    _same_answers(_uncalibrated(sys.executable, tmp_path), _uncalibrated(stock_python, tmp_path))


def test_gate_up_split_patched_stock_equals_plugin(fixed, stock_python):
    """Gate and up with their own weight global scales: the patch folds the up half's ratio
    into GEMM2's scales where vLLM reads the checkpoint, the plugin where vLLM hands them to
    the helper; the same arithmetic but for the ratio's last bit on compressed-tensors (the
    patch divides the reciprocals vLLM forms, the plugin the stored global scales)."""
    if "upstream_carries_gate_up" not in fixed:
        pytest.fail("run this module in the world with every patch (VLLM_FP4_MOE_PATCHED=all)")
    # one rank, compressed-tensors (where the two differ in the ratio's last bit), FlashInfer
    # CUTLASS: the EP row mapping of ModelOpt's all-experts scales is the patch's own test, the
    # other backends read the same folded scales
    args = ("--gate-up-split", "4", "--layout", "single", "--format", "compressed-tensors",
            "--backend", "flashinfer_cutlass")
    patched, stock = _matrix(sys.executable, *args), _matrix(stock_python, *args)
    assert patched.keys() == stock.keys() and stock
    for key, s in stock.items():
        p = patched[key]
        assert p["stock_error"] is None and s["plugin_error"] is None, key
        assert s["stock_affected"] and not s["bit_identical"], key  # stock 0.34.0 is wrong
        assert p["ok"] and s["ok"], (key, p, s)
        assert p["stock_rel_err"] == pytest.approx(s["plugin_rel_err"], rel=1e-3, abs=1e-6), key
        assert p["bit_identical"] or p["plugin_rel_err"] == pytest.approx(
            p["stock_rel_err"], rel=1e-3, abs=1e-6), key



def test_uncalibrated_refused_upstream_served_by_plugin(fixed, stock_python, tmp_path):
    """0005 off: patched stock refuses the planted zero amax by name (0002) and serves the finite
    ones as stock does; the plugin serves every row as on stock 0.34.0. (The ``missing`` plant
    hands stock the value memory held, as on stock; that the patched loader leaves it NaN, and
    the check refuses NaN, are 0002's own tests.)"""
    if "upstream_repairs_uncalibrated" not in fixed:
        pytest.fail("run this module in the world with every patch (VLLM_FP4_MOE_PATCHED=all)")
    env = {**os.environ, REPAIR_OPT_IN: "0"}
    patched, stock = _uncalibrated(sys.executable, tmp_path, env), _uncalibrated(stock_python,
                                                                                 tmp_path)
    _same_plugin_answers(patched, stock)
    for key, p in patched.items():
        refused = key[3] == "zero"  # amax 0 (ModelOpt) or inf (1 / 0); not tiny or large
        assert bool(p["stock_error"]) == refused, (key, p["stock_error"])
        if refused:
            assert "activation scale of 1 expert(s) [1]" in p["stock_error"], p["stock_error"]
        elif not (key[0] == "compressed-tensors" and "ep" in key[1]):  # 0001 changes those
            assert p["stock_rel_err"] == stock[key]["stock_rel_err"], key
