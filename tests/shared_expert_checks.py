# SPDX-License-Identifier: Apache-2.0
"""What a matrix row with a shared expert beside the routed ones must show in every design's
world (DeepSeek's, GLM's and Qwen3-Next's MoE: the router weight on the output, the shared
expert handed to the layer as their model files hand it, its output added to the routed one):
the plugin at the reference that adds the shared expert to the ideal routed answer; where stock
has a hole it is far from it, everywhere else the plugin is stock bit for bit."""

from fp4_moe_lab.simulation.layouts import Scenario
from fp4_moe_lab.simulation.matrix import run_matrix
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND


def check_shared_expert_rows(layouts, holes, backends=None) -> list:
    """``holes``: the (format, layout, backend) rows stock gets wrong in this release."""
    rows = run_matrix(layouts, Scenario(shared_expert=True), backends=backends)
    assert rows
    for r in rows:
        what = (r.format, r.layout, r.backend, r.stock_rel_err, r.plugin_rel_err, r.noise_floor)
        assert r.stock_error is None and r.plugin_error is None, what
        assert r.plugin_rel_err <= PLUGIN_BOUND, what
        assert r.plugin_fp32_err <= FP32_FACTOR * r.noise_floor, what
        if (r.format, r.layout, r.backend) in holes:
            assert r.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, what
            assert r.stock_affected and not r.bit_identical, what
        else:
            assert not r.stock_affected and r.bit_identical, what
        assert r.ok, what
    return rows
