# SPDX-License-Identifier: Apache-2.0
"""doctor on a 0.11.1-era release: it names the design and judges layers by *its* holes."""

import pytest

from vllm_fp4_moe_plugin.tools import doctor


@pytest.fixture
def env(blackwell_env):
    """FlashInfer CUTLASS, the path the matrix measures on this design (0.12.0's default backend,
    latency, is TRT-LLM, which doctor does not model here: tests/ut/test_gpu_families.py)."""
    blackwell_env.setenv("VLLM_FLASHINFER_MOE_BACKEND", "throughput")
    return blackwell_env


@pytest.mark.parametrize("fmt,layout,stock_ok", [
    ("modelopt", doctor.deployed_layout(dp=2, ep=True), True),           # #26135
    ("compressed-tensors", doctor.deployed_layout(tp=2, ep=True), True),  # #27223
    ("compressed-tensors", doctor.deployed_layout(dp=2, ep=True), False),  # the hole left open
])
def test_layers_judged_by_this_releases_holes(env, spread_checkpoints, fmt, layout, stock_ok):
    r = doctor.run_doctor(str(spread_checkpoints[fmt]), layout, capability="10.0")
    assert r["probes"]["design"] == "modular_method"
    assert r["layers"] and all(row["stock_consistent"] is stock_ok for row in r["layers"])
    assert r["verdict"] == (doctor.FINE if stock_ok else doctor.AT_RISK)  # plugin off
    env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(str(spread_checkpoints[fmt]), layout, capability="10.0")
    assert r["plugin"]["would_be_active"] and r["verdict"] == doctor.FINE
    assert all(row["plugin_consistent"] for row in r["layers"])


def test_all2allv_without_dp_is_a_hole_for_modelopt_too(env, spread_checkpoints):
    env.setenv("VLLM_ALL2ALL_BACKEND", "flashinfer_all2allv")
    r = doctor.run_doctor(str(spread_checkpoints["modelopt"]), doctor.deployed_layout(tp=2),
                          capability="10.0")
    assert r["layout"]["name"] == "tp_all2allv"
    assert r["verdict"] == doctor.AT_RISK
    assert "would replace" in doctor.format_doctor(r)
