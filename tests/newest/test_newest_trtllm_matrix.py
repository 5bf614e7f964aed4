"""FlashInfer TRT-LLM rows of the matrix on the NVFP4-oracle release (CI: vLLM 0.34.0), CPU.

``--moe-backend flashinfer_trtllm`` (vLLM's default NVFP4 MoE backend on SM100): the oracle
picks FLASHINFER_TRTLLM, vLLM shuffles the weights into the TRT-LLM layout
(Q/utils/flashinfer_fp4_moe.py:327-441, FlashInfer's permute-index helpers and SF interleave
stood in for on CPU). Without all-to-all kernels it builds the self-routing
``TrtLlmNvFp4ExpertsMonolithic`` (``trtllm_fp4_block_scale_moe``), here on a DeepSeek-V3-style
layer (grouped top-k with correction bias); under DP+EP ``TrtLlmNvFp4ExpertsModular``
(``trtllm_fp4_block_scale_routed_moe``, routing by vLLM). Both kernels are the FlashInfer 0.7
emulator (simulation/blackwell_oracle.py). TRT-LLM is a global-sf backend like CUTLASS, so the
hole is the same: stock compressed-tensors under DP+EP with a sender-quantizing dispatch; the plugin fixes
it and is bit-identical to stock everywhere else.
"""

import pytest

from vllm_fp4_moe_plugin.simulation.layouts import LAYOUTS, Scenario, run_layout
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND
from vllm_fp4_moe_plugin.simulation.matrix import (rows_for_layout, trtllm_layer_kwargs,
                                                   trtllm_routes_itself)

pytestmark = [pytest.mark.cpu, pytest.mark.multiproc, pytest.mark.slow]

# layout -> (experts, prepare/finalize) vLLM builds with FLASHINFER_TRTLLM
LAYOUT_KERNEL = {
    "dp_ep_allgather": ("TrtLlmNvFp4ExpertsModular", "MoEPrepareAndFinalizeNaiveDPEPModular"),
    "tp_ep": ("TrtLlmNvFp4ExpertsMonolithic", "MoEPrepareAndFinalizeNoDPEPMonolithic"),
    "single": ("TrtLlmNvFp4ExpertsMonolithic", "MoEPrepareAndFinalizeNoDPEPMonolithic"),
}
HOLES = {("compressed-tensors", "dp_ep_allgather")}
FORMATS = ("modelopt", "compressed-tensors")

_runs: dict = {}


def _run(layout: str):
    if layout not in _runs:
        spec = LAYOUTS[layout]
        kw = (trtllm_layer_kwargs(Scenario())
              if trtllm_routes_itself("flashinfer_trtllm", spec) else None)
        ranks = run_layout(spec, Scenario(), formats=FORMATS, backend="latency", layer_kwargs=kw)
        rows = rows_for_layout(layout, Scenario(), FORMATS, backend="flashinfer_trtllm",
                               ranks=ranks)
        _runs[layout] = ranks, {r.format: r for r in rows}
    return _runs[layout]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", list(LAYOUT_KERNEL))
def test_trtllm_rows(layout, fmt):
    ranks, rows = _run(layout)
    row = rows[fmt]
    for r in ranks:  # vLLM built the TRT-LLM path, stock and plugin alike
        for mode in ("stock", "plugin"):
            info = r.info[f"{fmt}/{mode}"]
            assert info["backend"] == "FLASHINFER_TRTLLM", info
            assert (info["experts"], info["prepare_finalize"]) == LAYOUT_KERNEL[layout], info
    assert row.backend == "flashinfer_trtllm" and row.design == "nvfp4_oracle"
    assert row.stock_error is None and row.plugin_error is None, row
    assert row.plugin_rel_err <= PLUGIN_BOUND, row
    assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
    if (fmt, layout) in HOLES:
        assert row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
        assert row.stock_affected and not row.bit_identical
    else:
        assert not row.stock_affected and row.bit_identical, row
    assert row.ok
