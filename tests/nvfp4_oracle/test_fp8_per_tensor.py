# SPDX-License-Identifier: Apache-2.0
"""FP8 per-tensor MoE under DP+EP (docs/UPSTREAM.md's note; outside the plugin's scope): vLLM
0.34.0's own scale helper, in real gloo ranks at DP=2+EP, collapses each EP rank's local experts'
static input scales to a different value unless EPLB is on, so a token quantized on one rank and
dequantized on the other is off by their ratio (the FP8 round trip emulated; no FP8 kernel)."""

import pytest

from fp4_moe_lab.simulation.fp8_per_tensor import cross_rank_errors
from fp4_moe_lab.simulation.layouts import LAYOUTS, spawn

pytestmark = [pytest.mark.multiproc]

FP8_NOISE = 0.05  # E4M3's 3 mantissa bits: a round trip of a Gaussian batch is ~0.02-0.03


def test_ep_ranks_collapse_fp8_input_scales_differently_without_eplb():
    ranks = spawn(LAYOUTS["dp_ep_allgather"], "fp4_moe_lab.simulation.fp8_per_tensor:"
                  "collapsed_scales")
    assert [r["ep_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["no_eplb"] < ranks[1]["no_eplb"]  # each rank its local max
    assert ranks[0]["eplb"] == ranks[1]["eplb"] == ranks[1]["no_eplb"]  # EPLB: the group's
    same = cross_rank_errors(ranks, "eplb")
    crossed = cross_rank_errors(ranks, "no_eplb")
    assert max(same.values()) <= FP8_NOISE, same
    assert crossed[(0, 0)] <= FP8_NOISE and crossed[(1, 1)] <= FP8_NOISE, crossed
    ratio = ranks[1]["no_eplb"] / ranks[0]["no_eplb"]
    assert crossed[(0, 1)] >= 0.5 * (ratio - 1) > 4 * FP8_NOISE, (ratio, crossed)
