# SPDX-License-Identifier: Apache-2.0
"""The consistency matrix on the installed NVFP4-oracle release (CI: vLLM 0.34.0), CPU.

Real vLLM code (quant methods, FusedMoEFactory/RoutedExperts, its weight loader,
process_weights_after_loading with the backend oracle, prepare/finalize, FlashInferExperts) in
real gloo ranks; only SM100 and FlashInfer are simulated (simulation/blackwell_oracle.py).
Stock compressed-tensors under DP+EP with a sender-quantizing dispatch is the hole: each rank
collapses GEMM1's input scale over its own experts. Everywhere else the plugin must be inert.
The rows are the session's ``matrix --json`` run (conftest ``matrix_rows``); the mechanism test
below builds its own layers because it reads the scales vLLM computed.
"""

from types import SimpleNamespace

import pytest
import torch

from fp4_moe_lab.simulation.layouts import LAYOUTS, Scenario, run_layout
from tests.nvfp4_oracle.features import skip_unless_matrix_has
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

# (layout, prepare/finalize vLLM must build there with FLASHINFER_CUTLASS)
LAYOUT_PF = {
    "tp_ep": "MoEPrepareAndFinalizeNoDPEPModular",  # replicated tokens, no all-to-all
    "dp_ep_allgather": "MoEPrepareAndFinalizeNaiveDPEPModular",  # the default dispatch
    "dp_ep_all2allv": "FlashInferNVLinkTwoSidedPrepareAndFinalize",
    "dp_ep_one_sided": "FlashInferNVLinkOneSidedPrepareAndFinalize",
}
HOLES = {("compressed-tensors", "dp_ep_allgather"), ("compressed-tensors", "dp_ep_all2allv"),
         ("compressed-tensors", "dp_ep_one_sided")}


def _row(rows: list, layout: str, fmt: str) -> SimpleNamespace:
    """The CUTLASS row of the session's ``matrix --json`` run (conftest ``matrix_rows``)."""
    found = [r for r in rows if (r["layout"], r["format"], r["backend"])
             == (layout, fmt, "flashinfer_cutlass")]
    assert len(found) == 1, (layout, fmt, len(found))
    return SimpleNamespace(**found[0])


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("layout", list(LAYOUT_PF))
def test_hole_fixed_and_everything_else_untouched(layout, fmt, matrix_rows):
    skip_unless_matrix_has(layout)
    row = _row(matrix_rows, layout, fmt)
    assert row.design == "nvfp4_oracle"
    assert row.plugin_prepare_finalize == LAYOUT_PF[layout], row
    assert row.stock_error is None and row.plugin_error is None, row
    # The plugin sits at this release's ideal NVFP4 answer and at the noise floor from fp32.
    assert row.plugin_rel_err <= PLUGIN_BOUND, row
    assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
    if (fmt, layout) in HOLES:
        assert row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
        assert row.stock_fp32_err > FP32_FACTOR * row.noise_floor, row  # worse than NVFP4 is
        assert row.stock_affected and not row.bit_identical
    else:  # ModelOpt everywhere, compressed-tensors without a sender-quantizing dispatch
        assert not row.stock_affected and row.bit_identical, row
    assert row.ok


def test_fixture_gives_the_ep_ranks_different_local_maxima():
    """Without this the hole could not show: EP=2 splits E=8 into experts 0-3 and 4-7, and the
    stock collapse is the max amax (= min input global scale) over each rank's block."""
    gs = Scenario().experts().w13_input_gs.float()
    assert gs[:4].min() != gs[4:].min()


def test_stock_ranks_disagree_on_gemm1_scale_and_the_plugin_agrees():
    """The mechanism, read off the layers vLLM built: under DP+EP each stock compressed-tensors
    rank quantizes GEMM1's input with its own local max; with the plugin every rank uses the
    max over all experts (= min over the checkpoint's input global scales), as ModelOpt does."""
    ranks = run_layout(LAYOUTS["dp_ep_allgather"], Scenario(),
                       formats=("compressed-tensors", "modelopt"))
    gs = Scenario().experts().w13_input_gs.float()
    want = float(gs.min())

    def scale(r, key):
        a1 = r.info[key]["a1_gscale"]
        assert len(set(a1)) == 1  # FlashInfer CUTLASS: one scale repeated per local expert
        return a1[0]

    stock = [scale(r, "compressed-tensors/stock") for r in ranks]
    assert stock == pytest.approx([float(gs[:4].min()), float(gs[4:].min())])
    for key in ("compressed-tensors/plugin", "modelopt/stock", "modelopt/plugin"):
        assert [scale(r, key) for r in ranks] == pytest.approx([want, want]), key
    for r in ranks:
        for key, info in r.info.items():  # what vLLM's oracle chose, not what we asked for
            assert info["backend"] == "FLASHINFER_CUTLASS", key
            assert info["experts"] == "FlashInferExperts", key
        assert r.info["compressed-tensors/stock"]["use_all2all_kernels"]
        assert torch.equal(r.outputs["modelopt/stock"], r.outputs["modelopt/plugin"])
