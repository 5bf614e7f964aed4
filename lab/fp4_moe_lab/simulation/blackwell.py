# SPDX-License-Identifier: Apache-2.0
"""The one seam where this project pretends to be a Blackwell (SM100) GPU.

Nothing here is used by ``register()`` or by any production code path. Tests, the ``matrix``
command and the demo enter :func:`simulated_blackwell` to run *real* vLLM 0.11.0 MoE code on a
CPU. Every replacement below stands in for hardware we do not have, and nothing else:

=====================================================  ===========================================
vLLM 0.11.0 symbol replaced                            why it has to be replaced on CPU
=====================================================  ===========================================
``nvfp4_moe_support.cutlass_fp4_supported``            capability probe: reports SM100
``nvfp4_moe_support.is_flashinfer_fp4_cutlass_moe_``   capability probe: keeps the env/FlashInfer
``available`` (and in ``flashinfer_fp4_moe``)          checks, drops ``is_cuda() and SM 10.0``
``flashinfer_cutlass_moe.flashinfer_cutlass_fused_``   FlashInfer kernel -> our emulator of the
``moe``                                                0.3.1 ``cutlass_fused_moe`` contract
``fused_moe.utils.fp4_quantize``, ``flashinfer.``      FlashInfer quantizer -> emulator (keeps the
``fp4_quantize``                                       "reads element 0 of a vector" behaviour)
``flashinfer_cutlass_prepare_finalize.nvfp4_block_``   FlashInfer SF interleave -> emulator
``scale_interleave``
``flashinfer_cutlass_prepare_finalize.flashinfer_``    MNNVL all-to-all needs NVLink; replaced by
``alltoall_dispatch`` / ``_combine``                   the same quantize-on-sender + gloo transport
``modelopt.swizzle_blockscale``, ``compressed_``       ends in ``.cuda()``; CPU twin of the layout
``tensors_moe.swizzle_blockscale``
``DeviceCommunicatorBase.all_gatherv`` /               raise NotImplementedError off-CUDA; CPU
``reduce_scatterv``                                    versions over the real gloo device group
``torch.cuda.current_device``                          ``FusedMoE.__init__`` allocates DP staging
                                                       buffers on it when FlashInfer CUTLASS is on
``fused_moe.vllm_topk_softmax``                        wraps the CUDA-only ``topk_softmax`` op; a
                                                       torch twin (models built by an engine do
                                                       not pass a ``custom_routing_function``)
=====================================================  ===========================================

``backend="latency"`` adds the TRT-LLM kernel and its weight-shuffle helpers
(:mod:`.trtllm_seam`, its own table).

Layer-level callers may instead pass vLLM's own ``custom_routing_function``
(:func:`cpu_topk_softmax_routing`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from fp4_moe_lab import nvfp4

_PF = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize"


def _fi_cutlass_moe_available() -> bool:
    # vLLM 0.11.0 flashinfer_fp4_moe.py:26-31 minus `is_cuda() and is_device_capability(100)`.
    import vllm.envs as envs
    from vllm.utils.flashinfer import has_flashinfer_cutlass_fused_moe

    return bool(envs.VLLM_USE_FLASHINFER_MOE_FP4 and has_flashinfer_cutlass_fused_moe())


def cpu_swizzle_blockscale(scale: torch.Tensor) -> torch.Tensor:
    """vLLM's ``swizzle_blockscale`` (quant_utils.py:591-634) without the trailing ``.cuda()``."""
    assert scale.dtype == torch.float8_e4m3fn
    return nvfp4.swizzle_128x4(scale)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # gloo has no fp8 type; 1-byte floats travel as uint8.
    return t.view(torch.uint8) if t.dtype.itemsize == 1 and t.is_floating_point() else t


def _gatherv_one(t: torch.Tensor, dim: int, sizes: list[int], group) -> torch.Tensor:
    assert dim == 0, "CPU all_gatherv only supports dim=0 (all vLLM 0.11.0 callers use it)"
    wire = _as_bytes(t.contiguous())
    pad = max(sizes)
    buf = wire.new_zeros((pad,) + tuple(wire.shape[1:]))
    buf[: wire.shape[0]] = wire
    parts = [torch.empty_like(buf) for _ in sizes]
    dist.all_gather(parts, buf, group=group)
    out = torch.cat([p[:n] for p, n in zip(parts, sizes)], dim=0)
    return out.view(t.dtype) if out.dtype != t.dtype else out


def _cpu_all_gatherv(self, input_, dim: int = 0, sizes: Optional[list[int]] = None):
    """CPU ``DeviceCommunicatorBase.all_gatherv`` over the real gloo device group."""
    group = self.device_group
    tensors = input_ if isinstance(input_, (list, tuple)) else [input_]
    if sizes is None:
        sizes = [tensors[0].shape[0]] * self.world_size
    out = [_gatherv_one(t, dim, list(sizes), group) for t in tensors]
    return out if isinstance(input_, (list, tuple)) else out[0]


def _cpu_reduce_scatterv(self, input_: torch.Tensor, dim: int = -1,
                         sizes: Optional[list[int]] = None) -> torch.Tensor:
    """CPU ``DeviceCommunicatorBase.reduce_scatterv``: fp32 all-reduce, keep this rank's rows."""
    if dim < 0:
        dim += input_.dim()
    assert dim == 0, "CPU reduce_scatterv only supports dim=0"
    if sizes is None:
        sizes = [input_.shape[0] // self.world_size] * self.world_size
    total = input_.float().contiguous()
    dist.all_reduce(total, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return total[start:start + sizes[self.rank_in_group]].to(input_.dtype)


def _cpu_alltoall_dispatch(all2all_manager, global_num_tokens_cpu, x, gs, topk_ids,
                           topk_weights, top_k, num_experts, quant_config,
                           use_deepseek_fp8_block_scale: bool = False):
    """Stock ``flashinfer_alltoall_dispatch`` (PF:207-264) with MNNVL swapped for gloo.

    The numerics are kept: the *sender* quantizes with ``gs`` in linear SF layout, the receiver
    interleaves. Transport is an all-gather (every rank receives every token; the kernel skips
    non-local experts), which gives the same per-rank expert outputs as a true all-to-all.
    """
    from vllm.distributed import get_ep_group
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    if use_deepseek_fp8_block_scale:  # vLLM 0.12.0's FP8 block-scale variant: not NVFP4
        raise NotImplementedError("the CPU all-to-all twin covers NVFP4 only")
    pf = importlib.import_module(_PF)
    xq, x_sf = moe_kernel_quantize_input(
        x, gs, quant_config.quant_dtype, quant_config.per_act_token_quant,
        quant_config.block_shape, is_fp4_scale_swizzled=False)
    comm = get_ep_group().device_communicator
    sizes = list(global_num_tokens_cpu)
    topk_weights, topk_ids, xq, x_sf = _cpu_all_gatherv(
        comm, [topk_weights, topk_ids, xq, x_sf], dim=0, sizes=sizes)
    x_sf = pf.nvfp4_block_scale_interleave(x_sf)
    info = {"sizes": sizes, "rank": comm.rank_in_group}
    return info, topk_ids, topk_weights, xq, x_sf


def _cpu_alltoall_combine(all2all_manager, output, top_k, token_count, alltoall_info):
    """Stock ``flashinfer_alltoall_combine`` with MNNVL swapped for a gloo reduce-scatter."""
    from vllm.distributed import get_ep_group

    comm = get_ep_group().device_communicator
    return _cpu_reduce_scatterv(comm, output, dim=0, sizes=alltoall_info["sizes"])


def cpu_topk_softmax_routing(hidden_states: torch.Tensor, gating_output: torch.Tensor,
                             topk: int, renormalize: bool):
    """A ``custom_routing_function`` for CPU: softmax, top-k, optional renormalization."""
    probs = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = probs.topk(topk, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(torch.float32), ids.to(torch.int32)


def _cpu_vllm_topk_softmax(topk_weights, topk_indices, token_expert_indices, gating_output,
                           renormalize):
    """torch twin of fused_moe.py:954-967 (``ops.topk_softmax`` + optional renormalization)."""
    probs = torch.softmax(gating_output.float(), dim=-1)
    weights, ids = probs.topk(topk_weights.shape[-1], dim=-1)
    topk_weights.copy_(weights)
    topk_indices.copy_(ids.to(topk_indices.dtype))
    m, k = ids.shape
    token_expert_indices.copy_(
        (torch.arange(k, device=ids.device) * m).unsqueeze(0) + torch.arange(m).unsqueeze(1))
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_indices


class _Patcher:
    def __init__(self) -> None:
        self._undo: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, attr: str, value: Any, *, only_if_present: bool = False) -> None:
        if isinstance(owner, str):
            owner = importlib.import_module(owner)
        if only_if_present and not hasattr(owner, attr):
            return
        self._undo.append((owner, attr, getattr(owner, attr)))
        setattr(owner, attr, value)

    def undo(self) -> None:
        while self._undo:
            owner, attr, value = self._undo.pop()
            setattr(owner, attr, value)


def _flashinfer_0_5_call(moe_kernel):
    """vLLM 0.11.1+ call FlashInfer 0.5's ``cutlass_fused_moe`` with ``activation_type``
    (FlashInferExperts.apply there). The NVFP4 contract is otherwise 0.3.1's: the same six
    quant scales, scalar-or-per-local-expert act scales (fi 0.5.3
    flashinfer_cutlass_fused_moe_sm100_binding.cu:1036-1062) and ``SFScale[0]`` in the
    quantizer (quantization.cuh:763). Only SwiGLU is emulated; anything else is refused."""

    def call(*args, activation_type=None, **kwargs):
        if activation_type is not None and getattr(activation_type, "name", "Swiglu") != "Swiglu":
            raise NotImplementedError(f"emulator covers SwiGLU only, not {activation_type!r}")
        return moe_kernel(*args, **kwargs)

    return call


@contextlib.contextmanager
def simulated_blackwell(*, backend: str = "throughput",
                        kernel: str = "emulator") -> Iterator[None]:
    """Run vLLM 0.11.0's FlashInfer NVFP4 MoE code on CPU, with the emulator as the kernel.

    ``backend`` is vLLM's ``VLLM_FLASHINFER_MOE_BACKEND`` ("throughput" = CUTLASS,
    "latency" = TRT-LLM). ``VLLM_USE_FLASHINFER_MOE_FP4=1`` is set for the duration, since that
    is how a Blackwell user selects the FlashInfer path. ``kernel="reference"`` replaces the
    MoE kernel by the ideal-NVFP4 oracle (:mod:`.reference_kernel`), for end-to-end references;
    ``kernel="shadow"`` keeps the emulator and checks every call against that oracle.
    """
    if kernel not in ("emulator", "reference", "shadow"):
        raise ValueError(f"kernel must be 'emulator', 'reference' or 'shadow', not {kernel!r}")
    if kernel == "reference":
        from fp4_moe_lab.simulation.reference_kernel import reference_cutlass_fused_moe
        moe_kernel = reference_cutlass_fused_moe
    elif kernel == "shadow":
        from fp4_moe_lab.simulation.reference_kernel import shadow_cutlass_fused_moe
        moe_kernel = shadow_cutlass_fused_moe
    else:
        moe_kernel = nvfp4.cutlass_fused_moe
    import flashinfer
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    saved_env = {k: os.environ.get(k) for k in
                 ("VLLM_USE_FLASHINFER_MOE_FP4", "VLLM_FLASHINFER_MOE_BACKEND")}
    os.environ["VLLM_USE_FLASHINFER_MOE_FP4"] = "1"
    os.environ["VLLM_FLASHINFER_MOE_BACKEND"] = backend
    p = _Patcher()
    q = "vllm.model_executor.layers.quantization"
    try:
        p.set(f"{q}.utils.nvfp4_moe_support", "cutlass_fp4_supported", lambda: True)
        p.set(f"{q}.utils.nvfp4_moe_support", "is_flashinfer_fp4_cutlass_moe_available",
              _fi_cutlass_moe_available)
        p.set(f"{q}.utils.flashinfer_fp4_moe", "is_flashinfer_fp4_cutlass_moe_available",
              _fi_cutlass_moe_available)
        p.set("vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe",
              "flashinfer_cutlass_fused_moe", _flashinfer_0_5_call(moe_kernel))
        # 0.11.0 imports flashinfer's quantizer as `fp4_quantize`, 0.11.1+ through vLLM's lazy
        # wrapper as `flashinfer_fp4_quantize` (which caches the real one on first call).
        p.set("vllm.model_executor.layers.fused_moe.utils", "fp4_quantize", nvfp4.fp4_quantize,
              only_if_present=True)
        p.set("vllm.model_executor.layers.fused_moe.utils", "flashinfer_fp4_quantize",
              nvfp4.fp4_quantize, only_if_present=True)
        p.set(flashinfer, "fp4_quantize", nvfp4.fp4_quantize)
        p.set(_PF, "nvfp4_block_scale_interleave", nvfp4.block_scale_interleave)
        p.set(_PF, "flashinfer_alltoall_dispatch", _cpu_alltoall_dispatch)
        p.set(_PF, "flashinfer_alltoall_combine", _cpu_alltoall_combine)
        p.set(f"{q}.modelopt", "swizzle_blockscale", cpu_swizzle_blockscale)
        p.set(f"{q}.compressed_tensors.compressed_tensors_moe", "swizzle_blockscale",
              cpu_swizzle_blockscale)
        p.set(DeviceCommunicatorBase, "all_gatherv", _cpu_all_gatherv)
        p.set(DeviceCommunicatorBase, "reduce_scatterv", _cpu_reduce_scatterv)
        p.set(torch.cuda, "current_device", lambda: torch.device("cpu"))
        p.set("vllm.model_executor.layers.fused_moe.fused_moe", "vllm_topk_softmax",
              _cpu_vllm_topk_softmax)
        if backend == "latency":
            from fp4_moe_lab.simulation import trtllm_seam
            trtllm_seam.install(p)
        yield
    finally:
        p.undo()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
