# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.11.0's TRT-LLM ("latency") NVFP4 MoE backend, ModelOpt, in real gloo groups.

The kernel is the FlashInfer 0.3.1 ``trtllm_fp4_block_scale_moe`` emulator
(``nvfp4/trtllm_emulator.py``); everything else -- weight shuffles, ``fp4_quantize`` with the
layer's scale vector, the kernel call, DP dispatch -- is vLLM's own code
(``simulation/trtllm_rows.py``). Stock quantizes every token with expert 0's scale while the
output scales are per expert; the plugin sets one scalar per EP rank and rebuilds them.
"""

import pytest

from fp4_moe_lab.simulation import trtllm_rows
from fp4_moe_lab.simulation.layouts import Scenario
from fp4_moe_lab.simulation.matrix import installed_release
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND
from vllm_fp4_moe_plugin.base.support import Design

pytestmark = pytest.mark.multiproc

SCENARIO = Scenario()  # E=8, H=256, I=512, top-2, 32 tokens/rank, 4x input-scale spread


@pytest.mark.parametrize("layout", trtllm_rows.LAYOUTS)
def test_trtllm_layout(layout):
    if installed_release()[1] is not Design.INIT_PREPARE_FINALIZE:
        pytest.skip("the TRT-LLM seam covers vLLM 0.11.0's design")
    ranks = trtllm_rows.run_layout(layout, SCENARIO)
    for r in ranks:
        for mode in ("stock", "plugin"):
            assert "TENSORRT_LLM" in r.info[f"modelopt/{mode}"]["backend"]
            assert r.info[f"modelopt/{mode}"]["prepare_finalize"] == "direct"
    (row,) = trtllm_rows.rows_for_layout(layout, SCENARIO, ranks=ranks)
    assert row.backend == "flashinfer_trtllm" and row.format == "modelopt"
    # Reference check: the ideal NVFP4 answer with the kernel's DeepSeekV3 routing and one
    # GEMM1 scale per EP rank; the plugin within the bound and at the fp32 noise floor, stock
    # (expert 0's scale for every token) at least AFFECTED_FACTOR x the bound away.
    assert row.plugin_error is None and row.stock_error is None, row
    assert row.plugin_rel_err <= PLUGIN_BOUND, row
    assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
    assert row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
    assert row.stock_affected and row.ok
