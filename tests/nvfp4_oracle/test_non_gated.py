# SPDX-License-Identifier: Apache-2.0
"""Non-gated experts (Nemotron-H's relu2: up_proj and down_proj, vLLM's ``relu2_no_mul``) on
vLLM 0.34.0's real NVFP4 MoE layer, built as models/nemotron_h.py builds it, on FlashInfer
CUTLASS (the backend vLLM #52308 points operators to): the GEMM1 input scale hole is the gated
experts' (compressed-tensors at DP+EP: a rank quantizes with its own local max), the plugin
fixes it, and everywhere else it leaves stock's output bit for bit."""

import pytest

from fp4_moe_lab.simulation.layouts import Scenario
from fp4_moe_lab.simulation.matrix import run_matrix
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND

pytestmark = [pytest.mark.multiproc]
LAYOUTS = ("single", "dp_ep_allgather")


def test_non_gated_experts_hole_fixed_and_stock_kept_elsewhere():
    rows = run_matrix(layouts=LAYOUTS,
                      scenario=Scenario(gated=False), backends=("flashinfer_cutlass",))
    assert {(r.format, r.layout) for r in rows} == {
        (f, lay) for f in ("modelopt", "compressed-tensors")
        for lay in LAYOUTS}
    for r in rows:
        what = (r.format, r.layout, r.stock_rel_err, r.plugin_rel_err, r.noise_floor)
        assert r.stock_error is None and r.plugin_error is None, what
        assert r.plugin_rel_err <= PLUGIN_BOUND, what  # at the emulator's noise
        assert r.plugin_fp32_err <= FP32_FACTOR * r.noise_floor, what  # at the NVFP4 floor
        hole = (r.format, r.layout) == ("compressed-tensors", "dp_ep_allgather")
        if hole:  # stock far above noise on the same inputs
            assert r.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, what
        else:  # never worse than stock: the same bits
            assert r.bit_identical, what
        assert r.ok, what


def test_an_uncalibrated_non_gated_expert_is_repaired_on_its_one_gemm1_scale():
    """llmcompressor's no-statistics value (1.57e-29) on one expert's up_proj input scale, the
    only GEMM1 scale a non-gated expert has: stock's MoE output is zero or far off, the plugin's
    at noise (it judges the [E, 1] scales as it judges gate/up pairs)."""
    rows = run_matrix(layouts=LAYOUTS, scenario=Scenario(gated=False, planted=("w13", "tiny")),
                      backends=("flashinfer_cutlass",))
    assert len(rows) == 4
    for r in rows:
        what = (r.format, r.layout, r.stock_rel_err, r.plugin_rel_err, r.noise_floor)
        assert r.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, what
        assert r.plugin_rel_err <= PLUGIN_BOUND, what
        assert r.plugin_fp32_err <= FP32_FACTOR * r.noise_floor and r.ok, what
