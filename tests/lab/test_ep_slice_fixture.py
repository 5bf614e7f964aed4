# SPDX-License-Identifier: Apache-2.0
"""The 0.34.0 world's accuracy fixture (fp4_moe_lab.simulation.ep_slice) plants what the EP-slice
benchmark rows need: EP=2 slices whose GEMM1 local maxima differ by exactly 1.25x, 2x and 4x,
and GEMM2 maxima that do not differ (so the only scheme difference left is GEMM1's scale).
vLLM-free."""

import pytest
import torch

from fp4_moe_lab.nvfp4 import global_scale
from fp4_moe_lab.nvfp4.reference import W2_INPUT_AMAX_BASE, W13_INPUT_AMAX_BASE
from fp4_moe_lab.simulation.ep_slice import EpSliceScenario, planted_amax, slice_maxima_ratio
from fp4_moe_lab.simulation.layouts import Scenario
from vllm_fp4_moe_plugin.base import support


@pytest.mark.parametrize("ratio", [1.25, 2.0, 4.0])
def test_slice_maxima_differ_by_exactly_the_ratio(ratio):
    a13, a2 = planted_amax(8, ratio, seed=0)
    lo, hi = support.rank_local_maxima(a13.tolist(), 2)
    assert hi == lo * ratio  # exact, not approximately
    assert slice_maxima_ratio(EpSliceScenario(slice_ratio=ratio)) == ratio
    m0, m1 = support.rank_local_maxima(a2.tolist(), 2)
    assert m0 == m1
    # never under the floors below which an expert's own scale could saturate
    assert a13.min() >= W13_INPUT_AMAX_BASE and a2.min() >= W2_INPUT_AMAX_BASE


def test_experts_carry_the_planted_scales_and_keep_the_scenario_weights():
    sc = EpSliceScenario(slice_ratio=2.0)
    ex, plain = sc.experts(), Scenario.experts(sc)  # the same seeds, unplanted
    a13, a2 = planted_amax(8, 2.0, seed=0)
    assert torch.equal(ex.w13_input_gs, global_scale(a13))
    assert torch.equal(ex.w2_input_gs, global_scale(a2))
    assert torch.equal(ex.w1, plain.w1) and torch.equal(ex.w2_sf, plain.w2_sf)
    # stock compressed-tensors under DP+EP is off by exactly the planted ratio
    assert support.stock_dp_ep_off_by((2688.0 / ex.w13_input_gs.double()).tolist(), 2) == (
        pytest.approx(2.0, rel=1e-6))
