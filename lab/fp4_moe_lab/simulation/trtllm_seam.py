# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.11.0's TRT-LLM ("latency") NVFP4 MoE backend on CPU: the seam (its rows: trtllm_rows).

Seam (installed by :func:`~.blackwell.simulated_blackwell` with ``backend="latency"``); each
replacement stands in for SM100 hardware and nothing else:

=====================================================  ===========================================
FlashInfer 0.3.1 symbol replaced                       why it has to be replaced on CPU
=====================================================  ===========================================
``flashinfer.fused_moe.trtllm_fp4_block_scale_moe``    SM100-only kernel (launcher.cu:665-667) ->
                                                       ``nvfp4.trtllm_fp4_block_scale_moe``
``flashinfer.fp4_quantization.block_scale_``           picks a JIT module by the GPU's capability;
``interleave`` (``shuffle_matrix_sf_a``'s last step)   -> the CPU twin of the same 128x4 layout
``flashinfer.reorder_rows_for_gated_act_gemm``         vLLM hands it float8 views (modelopt.py:
                                                       1211-1232); CPU torch cannot index float8,
                                                       so FlashInfer's own function runs on the
                                                       same bytes viewed as uint8
``DeviceCommunicatorBase.dispatch`` / ``combine``      the CUDA communicator hands FusedMoE's naive
(vLLM)                                                 DP dispatch to its all-to-all manager
                                                       (cuda_communicator.py:97-99, 306-323); the
                                                       CPU one has none, and the base class is a
                                                       no-op. vLLM's own ``AgRsAll2AllManager``
                                                       code runs instead, over the CPU
                                                       ``all_gatherv`` / ``reduce_scatterv``
=====================================================  ===========================================

vLLM's own code runs unchanged otherwise: ``prepare_static_weight_layouts_for_trtllm_moe``
(FlashInfer's ``shuffle_matrix_a`` / ``shuffle_matrix_sf_a`` included), ``apply``'s
``fp4_quantize`` (already the emulator, see ``blackwell.py``) and its call of the kernel.

Rows (:mod:`.trtllm_rows`): in vLLM 0.11.0 only ModelOpt takes this backend (compressed-tensors has
no TRT-LLM branch, ``compressed_tensors_moe.py``), and ``apply`` always asks for DeepSeekV3 routing
unless the model is Llama 4 (``modelopt.py:1452-1456``): the kernel then reads
``e_score_correction_bias`` (null for a model without one, which the emulator refuses), so the rows
use a DeepSeek-V3-style layer -- sigmoid scores, correction bias, grouped top-k.
"""

from __future__ import annotations

import torch

from fp4_moe_lab import nvfp4

#: DeepSeek-V3-style routing of the rows: groups, groups kept (8 experts: 2 groups of 4).
NUM_EXPERT_GROUP = 2
TOPK_GROUP = 1


def _bytes_reorder(reorder):
    def call(x: torch.Tensor) -> torch.Tensor:
        return reorder(x.view(torch.uint8)).view(x.dtype)

    return call


def _agrs_manager():
    import vllm.envs as envs
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

    if envs.VLLM_ALL2ALL_BACKEND != "allgather_reducescatter":
        raise NotImplementedError("the CPU naive dispatch covers VLLM_ALL2ALL_BACKEND="
                                  f"allgather_reducescatter only, not {envs.VLLM_ALL2ALL_BACKEND}")
    return AgRsAll2AllManager


def _cpu_dispatch(self, hidden_states, router_logits, is_sequence_parallel=False):
    # AgRsAll2AllManager.dispatch never reads its instance (all2all.py:106-125).
    return _agrs_manager().dispatch(None, hidden_states, router_logits, is_sequence_parallel)


def _cpu_combine(self, hidden_states, is_sequence_parallel=False):
    return _agrs_manager().combine(None, hidden_states, is_sequence_parallel)


def install(patcher) -> None:
    """Add the TRT-LLM replacements to ``simulated_blackwell``'s patcher."""
    import flashinfer
    import flashinfer.fp4_quantization as fp4q
    import flashinfer.fused_moe as fused_moe
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    patcher.set(fused_moe, "trtllm_fp4_block_scale_moe", nvfp4.trtllm_fp4_block_scale_moe)
    patcher.set(fp4q, "block_scale_interleave", nvfp4.block_scale_interleave)
    patcher.set(flashinfer, "reorder_rows_for_gated_act_gemm",
                _bytes_reorder(flashinfer.reorder_rows_for_gated_act_gemm))
    patcher.set(DeviceCommunicatorBase, "dispatch", _cpu_dispatch)
    patcher.set(DeviceCommunicatorBase, "combine", _cpu_combine)


def routing_bias(scenario) -> torch.Tensor:
    """The layer's ``e_score_correction_bias`` (fp32, as DeepSeek-V3 declares it,
    deepseek_v2.py:164-166), deterministic in the scenario's seed."""
    g = torch.Generator().manual_seed(scenario.seed * 1000 + 901)
    return torch.randn(scenario.num_experts, generator=g) * 0.1


def layer_kwargs(scenario) -> dict:
    return dict(use_grouped_topk=True, num_expert_group=NUM_EXPERT_GROUP, topk_group=TOPK_GROUP,
                scoring_func="sigmoid", e_score_correction_bias=routing_bias(scenario))
