# SPDX-License-Identifier: Apache-2.0
"""What a split gate/up matrix row must show in every design's world (real vLLM layers, each half
quantized from its own amax): stock far above NVFP4 noise, the plugin at it (its error against the
fp32 answer is the ideal kernel's; against the ideal NVFP4 realization it differs only where
GEMM1's bf16 output rounds ``r * up`` instead of ``up``: ``CARRY_BOUND``)."""

from fp4_moe_lab.simulation.judge import CARRY_BOUND
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND


def check_split_rows(rows) -> None:
    assert rows
    for r in rows:
        what = (r.format, r.layout, r.backend, r.stock_rel_err, r.plugin_rel_err, r.noise_floor)
        assert r.stock_error is None and r.plugin_error is None, what
        assert r.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, what  # stock: far above noise
        assert r.plugin_fp32_err <= FP32_FACTOR * r.noise_floor, what  # the plugin: at it
        assert r.plugin_rel_err <= CARRY_BOUND * r.noise_floor, what
        assert r.ok, what  # the matrix's own verdict on a split row agrees
