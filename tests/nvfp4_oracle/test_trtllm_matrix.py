# SPDX-License-Identifier: Apache-2.0
"""FlashInfer TRT-LLM rows of the matrix on the NVFP4-oracle release (CI: vLLM 0.34.0), CPU.

``--moe-backend flashinfer_trtllm`` (vLLM's default NVFP4 MoE backend on SM100): the oracle
picks FLASHINFER_TRTLLM, vLLM shuffles the weights into the TRT-LLM layout
(Q/utils/flashinfer_fp4_moe.py:327-441, FlashInfer's permute-index helpers and SF interleave
stood in for on CPU; test_trtllm_layout.py checks those against FlashInfer 0.7's own).
Without all-to-all kernels it builds the self-routing ``TrtLlmNvFp4ExpertsMonolithic``
(``trtllm_fp4_block_scale_moe``), here on a DeepSeek-V3-style layer (grouped top-k with
correction bias); under DP+EP ``TrtLlmNvFp4ExpertsModular``
(``trtllm_fp4_block_scale_routed_moe``, routing by vLLM). Both kernels are the FlashInfer 0.7
emulator (simulation/blackwell_oracle.py). TRT-LLM is a global-sf backend like CUTLASS, so the
holes are the same: stock compressed-tensors under DP+EP with a sender-quantizing dispatch; the
plugin fixes them and is bit-identical to stock everywhere else.

The rows are those of the default ``matrix --json`` run (the session fixture ``matrix_rows``,
every layout); only the build check below runs layers of its own, in two layouts, because the
classes vLLM built are not in the rows.
"""

import pytest

from fp4_moe_lab.simulation.layouts import LAYOUTS, Scenario, run_layout
from fp4_moe_lab.simulation.matrix import trtllm_layer_kwargs, trtllm_routes_itself
from tests.nvfp4_oracle.features import skip_unless_matrix_has
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

FORMATS = ("modelopt", "compressed-tensors")
_MONO = "MoEPrepareAndFinalizeNoDPEPMonolithic"
# layout -> the plugin layer's prepare/finalize with FLASHINFER_TRTLLM
LAYOUT_PF = {
    "single": _MONO, "pp": _MONO, "tp": _MONO, "tp_ep": _MONO, "tp_all2allv": _MONO,
    "dp": "MoEPrepareAndFinalizeNaiveDPEPMonolithic",
    "dp_ep_allgather": "MoEPrepareAndFinalizeNaiveDPEPModular",
    "dp_ep_all2allv": "FlashInferNVLinkTwoSidedPrepareAndFinalize",
    "dp_ep_one_sided": "FlashInferNVLinkOneSidedPrepareAndFinalize",
}
HOLES = {("compressed-tensors", "dp_ep_allgather"), ("compressed-tensors", "dp_ep_all2allv"),
         ("compressed-tensors", "dp_ep_one_sided")}
# layout -> (experts, prepare/finalize) vLLM builds, stock and plugin alike: one layout per
# TRT-LLM experts class (the monolithic self-routing kernel, the modular routed one).
LAYOUT_KERNEL = {
    "single": ("TrtLlmNvFp4ExpertsMonolithic", _MONO),
    "dp_ep_allgather": ("TrtLlmNvFp4ExpertsModular", "MoEPrepareAndFinalizeNaiveDPEPModular"),
}


def _row(rows, layout, fmt):
    found = [r for r in rows if (r["layout"], r["format"], r["backend"])
             == (layout, fmt, "flashinfer_trtllm")]
    assert len(found) == 1, (layout, fmt, len(found))
    return found[0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", list(LAYOUT_PF))
def test_trtllm_rows(layout, fmt, matrix_rows):
    skip_unless_matrix_has(layout)
    row = _row(matrix_rows, layout, fmt)
    assert row["design"] == "nvfp4_oracle"
    assert row["plugin_prepare_finalize"] == LAYOUT_PF[layout], row
    assert row["stock_error"] is None and row["plugin_error"] is None, row
    assert row["plugin_rel_err"] <= PLUGIN_BOUND, row
    assert row["plugin_fp32_err"] <= FP32_FACTOR * row["noise_floor"], row
    if (fmt, layout) in HOLES:
        assert row["stock_rel_err"] >= AFFECTED_FACTOR * PLUGIN_BOUND, row
        assert row["stock_affected"] and not row["bit_identical"], row
    else:
        assert not row["stock_affected"] and row["bit_identical"], row
    assert row["ok"]


def test_every_layout_has_trtllm_rows():
    assert set(LAYOUT_PF) == set(LAYOUTS)


@pytest.mark.parametrize("layout", list(LAYOUT_KERNEL))
def test_vllm_builds_the_trtllm_path(layout):
    """What vLLM built, read off the layers: FLASHINFER_TRTLLM and its experts class."""
    spec = LAYOUTS[layout]
    kw = (trtllm_layer_kwargs(Scenario())
          if trtllm_routes_itself("flashinfer_trtllm", spec) else None)
    ranks = run_layout(spec, Scenario(), formats=FORMATS, backend="latency", layer_kwargs=kw)
    assert len(ranks) == spec.world
    for r in ranks:
        for fmt in FORMATS:
            for mode in ("stock", "plugin"):
                info = r.info[f"{fmt}/{mode}"]
                assert info["backend"] == "FLASHINFER_TRTLLM", info
                assert (info["experts"], info["prepare_finalize"]) == LAYOUT_KERNEL[layout], info
                assert f"{fmt}/{mode}" in r.outputs, r.errors  # the forward ran
