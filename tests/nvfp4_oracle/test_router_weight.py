# SPDX-License-Identifier: Apache-2.0
"""The router weight on the input (Llama-4, top-1) counted once: the wrapper on vLLM 0.34.0's
modular kernel hands NVFP4 experts unit weights exactly where the prepare applied the weight
(read from each prepare's source), and changes nothing anywhere else. The layer-level proof is
tests/nvfp4_oracle/test_families.py (matrix --router-weight-on-input)."""

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.fused_moe.prepare_finalize import naive_dp_ep, no_dp_ep, passthrough

from vllm_fp4_moe_plugin.patches.nvfp4_oracle import router_weight_once


@pytest.mark.parametrize("cls, applies", [
    (no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular, True),
    (naive_dp_ep.MoEPrepareAndFinalizeNaiveDPEPModular, True),
    (passthrough.PassThroughPrepareAndFinalize, False),  # the experts weight themselves
])
def test_which_prepares_apply_the_weight(cls, applies):
    assert router_weight_once.prepare_applies_weight(cls) is applies


def _kernel(prepare_cls, quant_dtype):
    kernel = SimpleNamespace(prepare_finalize=object.__new__(prepare_cls),
                             fused_experts=SimpleNamespace(
                                 quant_config=SimpleNamespace(quant_dtype=quant_dtype)))
    seen = {}

    def original(self, *, topk_weights, apply_router_weight_on_input, **rest):
        seen["topk_weights"] = topk_weights
        return "out"

    return kernel, router_weight_once.build(original), seen


@pytest.mark.parametrize("prepare_cls, quant_dtype, on_input, unit", [
    (no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular, "nvfp4", True, True),
    (naive_dp_ep.MoEPrepareAndFinalizeNaiveDPEPModular, "nvfp4", True, True),
    (no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular, "nvfp4", False, False),  # every other model
    (passthrough.PassThroughPrepareAndFinalize, "nvfp4", True, False),
    (no_dp_ep.MoEPrepareAndFinalizeNoDPEPModular, torch.float8_e4m3fn, True, False),  # not ours
])
def test_experts_get_unit_weights_only_where_the_prepare_weighted(prepare_cls, quant_dtype,
                                                                   on_input, unit):
    kernel, wrapped, seen = _kernel(prepare_cls, quant_dtype)
    weights = torch.tensor([[0.25], [0.75]])
    assert wrapped(kernel, topk_weights=weights, apply_router_weight_on_input=on_input) == "out"
    if unit:
        torch.testing.assert_close(seen["topk_weights"], torch.ones_like(weights))
    else:
        assert seen["topk_weights"] is weights
    torch.testing.assert_close(weights, torch.tensor([[0.25], [0.75]]))  # the finalize's own
