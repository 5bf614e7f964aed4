# SPDX-License-Identifier: Apache-2.0
"""Prepare/finalize, experts and direct call for the FlashInfer CUTLASS NVFP4 MoE path, with the
bf16 passthrough (:mod:`..bf16_passthrough`) where vLLM 0.11.0 quantizes in ``prepare``
(flashinfer_cutlass_prepare_finalize.py:95-104, 171-178). They are *subclasses* used only by our
NVFP4 quant methods: the stock classes are shared with the FP8 path
(quantization/utils/flashinfer_utils.py:176-198) and stay untouched.
"""

from __future__ import annotations

from typing import Optional

import torch
import vllm.envs as vllm_envs
import vllm.model_executor.layers.fused_moe.modular_kernel as mk
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe import FlashInferExperts
from vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize import (
    FlashInferAllGatherMoEPrepareAndFinalize,
    FlashInferAllToAllMoEPrepareAndFinalize,
)

from vllm_fp4_moe_plugin.patches.bf16_passthrough import Bf16PassthroughPrepareMixin


class KernelQuantizedPrepareAndFinalize(Bf16PassthroughPrepareMixin,
                                        FlashInferAllGatherMoEPrepareAndFinalize):
    """Non-DP prepare that hands bf16 to the kernel, so it quantizes with each expert's scale
    (:mod:`..bf16_passthrough`, upstream's fix in vLLM 0.11.1, PR #27223). With ``use_dp=True``
    it is the stock all-gather prepare (quantize once, then gather)."""


class KernelOutputShapeFlashInferExperts(FlashInferExperts):
    """``FlashInferExperts`` whose output buffer is ``(tokens, hidden)`` for bf16 input too:
    stock ``workspace_shapes`` (flashinfer_cutlass_moe.py:112-121) doubles the last dim of ``aq``
    for nvfp4 (packed FP4), ``(M, 2H)`` for bf16, which FlashInfer's shape check refuses."""

    fp4_moe_output_for_bf16 = True  # read by the load-time check (consistency)

    def workspace_shapes(self, a, aq, M, N, K, topk, global_num_experts, local_num_experts,
                         expert_tokens_meta):
        output_shape = (aq.size(0), a.size(-1))
        return (output_shape, (0,), output_shape, a.dtype)


def make_prepare_finalize(moe: FusedMoEConfig) -> mk.FusedMoEPrepareAndFinalize:
    """No DP: bf16 passthrough (also instead of stock's pre-quantizing
    ``AllToAll(use_dp=False)``); DP: the stock all-to-all or all-gather, which quantize on the
    sender and are correct once the quant config carries one shared scalar scale."""
    use_dp = moe.moe_parallel_config.dp_size > 1
    if use_dp and vllm_envs.VLLM_ALL2ALL_BACKEND == "flashinfer_all2allv":
        return FlashInferAllToAllMoEPrepareAndFinalize(use_dp=True)
    return KernelQuantizedPrepareAndFinalize(use_dp=use_dp)


def make_experts(moe: FusedMoEConfig,
                 quant_config: FusedMoEQuantConfig) -> mk.FusedMoEPermuteExpertsUnpermute:
    """Same parameters as vLLM's ``select_nvfp4_gemm_impl`` (flashinfer_fp4_moe.py:66-74)."""
    p = moe.moe_parallel_config
    return KernelOutputShapeFlashInferExperts(
        out_dtype=moe.in_dtype, quant_config=quant_config,
        ep_rank=p.ep_rank, ep_size=p.ep_size, tp_rank=p.tp_rank, tp_size=p.tp_size)


def flashinfer_cutlass_moe_fp4(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    quant_config: FusedMoEQuantConfig,
    inplace: bool = False,
    activation: str = "silu",
    global_num_experts: int = -1,
    expert_map: Optional[torch.Tensor] = None,
    apply_router_weight_on_input: bool = False,
) -> torch.Tensor:
    """The direct path (EP group of one: no modular kernel), with vLLM 0.11.0's signature
    (flashinfer_cutlass_moe.py:194-225); upstream's equivalent is 0.11.1's ``use_dp=False``."""
    fused_experts = mk.FusedMoEModularKernel(
        KernelQuantizedPrepareAndFinalize(use_dp=False),
        KernelOutputShapeFlashInferExperts(out_dtype=hidden_states.dtype,
                                           quant_config=quant_config),
    )
    return fused_experts(
        hidden_states=hidden_states, w1=w1, w2=w2, topk_weights=topk_weights,
        topk_ids=topk_ids, inplace=inplace, activation=activation,
        global_num_experts=global_num_experts, expert_map=expert_map,
        apply_router_weight_on_input=apply_router_weight_on_input)


flashinfer_cutlass_moe_fp4.fp4_moe_bf16_passthrough = True  # type: ignore[attr-defined]


def build_direct_call(_original):
    """The ledger's builder: the direct call is replaced outright (it is a function)."""
    return flashinfer_cutlass_moe_fp4
