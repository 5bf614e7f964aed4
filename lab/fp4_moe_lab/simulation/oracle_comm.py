# SPDX-License-Identifier: Apache-2.0
"""The MoE half of vLLM's CUDA communicator on gloo, for the oracle design (0.14.0+): the
device communicator the seam's platform hands out, and twins of FlashInfer's NVLink
all-to-all managers with their ``dispatch`` / ``combine`` contract. Part of the seam
:mod:`.blackwell_oracle` installs (its docstring lists every symbol replaced and why)."""

from __future__ import annotations

import importlib
import importlib.util
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist

from fp4_moe_lab import nvfp4
from fp4_moe_lab.simulation.blackwell import _as_bytes, _cpu_all_gatherv, _cpu_reduce_scatterv

_FM = "vllm.model_executor.layers.fused_moe"


class _GlooAllToAll:
    """The ``dispatch`` / ``combine`` contract of FlashInfer's NVLink two-/one-sided
    ``moe_ep`` communications (as vLLM calls them: flashinfer_nvlink_two_sided.py:150-197,
    flashinfer_nvlink_one_sided.py:126-160) over gloo.

    Transport is an all-gather padded to ``runtime_max_tokens_per_rank`` rows per rank (padding
    rows carry ``invalid_expert_id``, which no rank owns, as in the real kernel); the expert
    kernel skips experts that are not local, so each rank computes exactly the contributions a
    real all-to-all would deliver to it, and ``combine`` sums them back onto the sending rank.
    Quantization stays where vLLM puts it: on the sender, before ``dispatch``."""

    def __init__(self, group, num_experts: int):
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.params = SimpleNamespace(num_experts=num_experts)
        self._rows = 0

    def _gather(self, t: torch.Tensor, rows: int, fill) -> torch.Tensor:
        wire = _as_bytes(t.contiguous())
        buf = wire.new_full((rows,) + tuple(wire.shape[1:]), fill)
        buf[: wire.shape[0]] = wire
        parts = [torch.empty_like(buf) for _ in range(self.world)]
        dist.all_gather(parts, buf, group=self.group)
        out = torch.cat(parts, dim=0)
        return out.view(t.dtype) if out.dtype != t.dtype else out

    def dispatch(self, hidden_states, topk_ids, topk_weights, hidden_states_scale=None,
                 runtime_max_tokens_per_rank: Optional[int] = None,
                 max_tokens_per_rank: Optional[int] = None):
        # v0.33.0's one-sided P/F passes the same value as max_tokens_per_rank (FM/
        # prepare_finalize/flashinfer_nvlink_one_sided.py:119-125); 0.34.0 renamed it
        rows = runtime_max_tokens_per_rank or max_tokens_per_rank or hidden_states.shape[0]
        self._rows, self._mine = rows, hidden_states.shape[0]
        x = self._gather(hidden_states, rows, 0)
        ids = self._gather(topk_ids.to(torch.int32), rows, self.params.num_experts)
        w = self._gather(topk_weights, rows, 0)
        sf = None
        if hidden_states_scale is not None:
            sf = self._gather(hidden_states_scale, rows, 0)
        return SimpleNamespace(hidden_states=x, topk_ids=ids, topk_weights=w,
                               hidden_states_scale=sf)

    def combine(self, fused_expert_output: torch.Tensor, output=None) -> torch.Tensor:
        total = fused_expert_output.float().contiguous()
        dist.all_reduce(total, group=self.group)
        start = self.rank * self._rows
        mine = total[start:start + self._mine].to(fused_expert_output.dtype)
        if output is None:
            return mine
        output.copy_(mine)
        return output

    def get_combine_input_buffer(self, dtype):
        return torch.empty(0, dtype=dtype)  # never matches a shape: vLLM allocates its own

    def destroy(self) -> None:
        pass


def mnnvl_alltoall_dispatch(all2all_manager, global_num_tokens_cpu, x, gs, topk_ids,
                             topk_weights, top_k, num_experts, quant_config,
                             defer_input_quant: bool = False,
                             use_deepseek_fp8_block_scale: bool = False):
    """The older two-sided contract (v0.28.0 prepare_finalize/flashinfer_nvlink_two_sided.py:
    125-215, same in v0.20.0 and in v0.16.0 model_executor/layers/fused_moe/
    flashinfer_a2a_prepare_finalize.py:118-203: FlashInfer's ``MnnvlMoe`` alltoallv; in v0.14.0
    model_executor/layers/fused_moe/flashinfer_cutlass_prepare_finalize.py:249-325, which
    takes ``use_deepseek_fp8_block_scale`` instead of ``defer_input_quant``), MNNVL swapped for
    a gloo all-gather: the sender quantizes with ``gs`` in linear SF layout (:166-178; v0.14.0
    :289-297), the receiver interleaves (v0.14.0 :313-314); the
    kernel skips the experts it does not own, so every rank computes what a real all-to-all
    would hand it. The 0.34.0 form (``moe_ep`` communications) is :class:`_GlooAllToAll`."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    if defer_input_quant or use_deepseek_fp8_block_scale:
        raise NotImplementedError("the two-sided twin covers NVFP4 dispatch only")
    import inspect

    params = inspect.signature(moe_kernel_quantize_input).parameters
    # linear SF for the wire; the flag's name is is_fp4_scale_swizzled in v0.20.0
    extra = {("is_scale_swizzled" if "is_scale_swizzled" in params
              else "is_fp4_scale_swizzled"): False}
    if hasattr(quant_config, "mx_alignment"):  # 0.28.0, not 0.20.0
        extra["mx_alignment"] = quant_config.mx_alignment
    xq, x_sf = moe_kernel_quantize_input(
        x, gs, quant_config.quant_dtype, quant_config.per_act_token_quant,
        quant_config.block_shape, **extra)
    comm = _GlooAllToAll(all2all_manager.cpu_group, num_experts)
    rows = max(global_num_tokens_cpu) if global_num_tokens_cpu is not None else x.shape[0]
    got = comm.dispatch(xq, topk_ids, topk_weights, hidden_states_scale=x_sf,
                        runtime_max_tokens_per_rank=rows)
    sf = got.hidden_states_scale
    if sf is not None and getattr(quant_config, "is_scale_swizzled",
                                  getattr(quant_config, "is_nvfp4_scale_swizzled", True)):
        sf = nvfp4.block_scale_interleave(sf.view(torch.uint8))
    return comm, got.topk_ids, got.topk_weights, got.hidden_states, sf


def mnnvl_alltoall_combine(all2all_manager, output, top_k, token_count, alltoall_info):
    """v0.28.0 flashinfer_nvlink_two_sided.py:218-240 over gloo: sum onto the sending rank."""
    return alltoall_info.combine(output)


def present_module(name: str):
    """The module ``name`` if this vLLM has it, else None (also when a parent is missing, or is
    a plain module where later releases have a package: v0.14.0's
    model_executor/layers/fused_moe/prepare_finalize.py)."""
    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ImportError:  # ModuleNotFoundError: a parent is absent or not a package
        return None
    return importlib.import_module(name)


def two_sided_module():
    """Where FlashInfer's two-sided (``flashinfer_all2allv``) prepare/finalize lives:
    ``prepare_finalize/flashinfer_nvlink_two_sided.py`` (0.20.0+) or, before the
    ``prepare_finalize`` package, ``fused_moe/flashinfer_cutlass_prepare_finalize.py``
    (v0.14.0 model_executor/layers/fused_moe/flashinfer_cutlass_prepare_finalize.py:76-162,
    249-348: ``FlashInferAllToAllMoEPrepareAndFinalize`` and the module functions it calls)
    or ``fused_moe/flashinfer_a2a_prepare_finalize.py`` (v0.16.0 :21-115
    ``FlashInferA2APrepareAndFinalize``, :118-226 the same module functions, same MNNVL
    contract as v0.14.0's, with ``defer_input_quant``) or, renamed before it moved into the
    package, ``fused_moe/flashinfer_nvlink_two_sided_prepare_finalize.py`` (v0.18.0 :21-56,
    :118-226 the same functions)."""
    for name in (f"{_FM}.prepare_finalize.flashinfer_nvlink_two_sided",
                 f"{_FM}.flashinfer_nvlink_two_sided_prepare_finalize",
                 f"{_FM}.flashinfer_cutlass_prepare_finalize",
                 f"{_FM}.flashinfer_a2a_prepare_finalize"):
        mod = present_module(name)
        if mod is not None and hasattr(mod, "flashinfer_alltoall_dispatch"):
            return mod
    return None


def two_sided_is_mnnvl() -> bool:
    """0.14.0/0.20.0/0.28.0's two-sided P/F calls module functions with (..., top_k,
    num_experts, ...); 0.34.0's takes a ``moe_ep`` communication instead."""
    import inspect

    mod = two_sided_module()
    fn = getattr(mod, "flashinfer_alltoall_dispatch", None)
    return fn is not None and "top_k" in inspect.signature(fn).parameters


def _gloo_nvlink_managers():
    """Twins of ``FlashInferNVLinkTwoSidedManager`` / ``FlashInferNVLinkOneSidedManager``
    (v0.34.0 distributed/device_communicators/all2all.py:676-765, :766-930). Subclasses,
    because vLLM's P/Fs assert the manager's class (flashinfer_nvlink_two_sided.py:45); their
    ``__init__`` skips only the FlashInfer-installed assert and the MNNVL workspace, and
    ``get_communication`` / ``initialize`` hand out a :class:`_GlooAllToAll`."""
    from vllm.distributed.device_communicators.all2all import (
        All2AllManagerBase,
        FlashInferNVLinkOneSidedManager,
        FlashInferNVLinkTwoSidedManager,
    )

    class GlooTwoSided(FlashInferNVLinkTwoSidedManager):
        def __init__(self, cpu_group, tcp_store_group=None):
            All2AllManagerBase.__init__(self, cpu_group, tcp_store_group)
            self.communications = {}

        def get_communication(self, max_num_tokens, top_k, num_experts, hidden_size):
            key = (max_num_tokens, top_k, num_experts, hidden_size)
            if key not in self.communications:
                self.communications[key] = _GlooAllToAll(self.cpu_group, num_experts)
            return self.communications[key]

    class GlooOneSided(FlashInferNVLinkOneSidedManager):
        def __init__(self, cpu_group):
            All2AllManagerBase.__init__(self, cpu_group)
            self.initialized = False
            self.communication = None
            self.top_k = 0
            self.num_experts = 0

        def initialize(self, max_num_tokens, top_k, num_experts, hidden_size,
                       dispatch_format=None, extra_payload_bytes_per_token=0) -> None:
            if self.communication is None:
                self.communication = _GlooAllToAll(self.cpu_group, num_experts)
            self.initialized, self.top_k, self.num_experts = True, top_k, num_experts

        def get_communication(self):
            assert self.communication is not None, "initialize() first"
            return self.communication

        def cleanup(self) -> None:
            self.communication = None

        def checkpoint_prepare(self) -> None:
            pass

        def checkpoint_restore(self) -> None:
            pass

    return GlooTwoSided, GlooOneSided


def _gloo_all2allv_manager():
    """Twin of ``FlashInferAllToAllManager``, the ``flashinfer_all2allv`` manager of releases
    before the NVLink two-sided manager (v0.14.0 distributed/device_communicators/all2all.py:
    408-509): its ``__init__`` skips only the FlashInfer-installed assert (:418-421); the MNNVL
    workspace (``initialize``, :431-472) is never built, because the P/F's module functions
    that use it are :func:`mnnvl_alltoall_dispatch` / :func:`mnnvl_alltoall_combine`."""
    from vllm.distributed.device_communicators.all2all import (
        All2AllManagerBase,
        FlashInferAllToAllManager,
    )

    class GlooAllToAllV(FlashInferAllToAllManager):
        def __init__(self, cpu_group):
            All2AllManagerBase.__init__(self, cpu_group)
            self.initialized = False
            self.alltoall_info = None

        def ensure_alltoall_workspace_initialized(self):
            return True

        def cleanup(self):
            pass

    return GlooAllToAllV


def _two_sided_manager_class():
    """The two-sided manager twin this vLLM's P/F expects (see above)."""
    import vllm.distributed.device_communicators.all2all as a2a

    if hasattr(a2a, "FlashInferNVLinkTwoSidedManager"):
        return _gloo_nvlink_managers()[0]
    return _gloo_all2allv_manager()  # v0.14.0 all2all.py:408


def _communicator_class():
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase,
    )

    class CpuDeviceCommunicator(DeviceCommunicatorBase):
        """The MoE half of ``CudaCommunicator`` (v0.34.0 distributed/device_communicators/
        cuda_communicator.py:213-300 and :1060-1130) on gloo: all-to-all managers built the
        same way, ``dispatch``/``combine`` delegated to them, ``all_gatherv`` /
        ``reduce_scatterv`` as CPU collectives over the real gloo device group."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if not self.use_all2all:
                return
            backend = self.all2all_backend
            if backend in ("naive", "allgather_reducescatter"):
                from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

                self.all2all_manager = AgRsAll2AllManager(self.cpu_group)
            elif backend in ("flashinfer_all2allv", "flashinfer_nvlink_two_sided"):
                self.all2all_manager = _two_sided_manager_class()(self.cpu_group)
            elif backend == "flashinfer_nvlink_one_sided":
                self.all2all_manager = _gloo_nvlink_managers()[1](self.cpu_group)
            else:
                raise NotImplementedError(f"all2all backend {backend!r} is not simulated")

        all_gatherv = _cpu_all_gatherv
        reduce_scatterv = _cpu_reduce_scatterv

        def reduce_scatterv_into_output(self, input_, output, dim=0, sizes=None):
            output.copy_(_cpu_reduce_scatterv(self, input_, dim=dim, sizes=sizes))
            return output

        def get_symmetric_memory_buffer(self, *args, **kwargs):
            return None

        def dispatch_router_logits(self, hidden_states, router_logits,
                                   is_sequence_parallel=False, extra_tensors=None):
            return self.all2all_manager.dispatch_router_logits(
                hidden_states, router_logits, is_sequence_parallel, extra_tensors)

        # Handed on as called: the communicator and its manager take the same arguments in
        # each release, (hidden_states, topk_weights, topk_ids, ...) in 0.34.0,
        # (hidden_states, router_logits, ...) in v0.14.0 (distributed/device_communicators/
        # cuda_communicator.py:321-345 -> all2all.py:117-164, the naive DP dispatch of
        # model_executor/layers/fused_moe/layer.py:1957-1962).
        def dispatch(self, *args, **kwargs):
            return self.all2all_manager.dispatch(*args, **kwargs)

        def combine(self, *args, **kwargs):
            return self.all2all_manager.combine(*args, **kwargs)

        def allocate_combine_input(self, shape, dtype, device, is_sequence_parallel=False):
            return None

        def combine_into_output(self, hidden_states, output, is_sequence_parallel=False):
            output.copy_(self.combine(hidden_states, is_sequence_parallel))
            return output

    return CpuDeviceCommunicator


CpuDeviceCommunicator = None  # built lazily (needs vLLM); see _communicator_class


def install_communicator() -> str:
    """Build :data:`CpuDeviceCommunicator` (it subclasses a vLLM class, so only once vLLM is
    imported) and return the qualified name the platform hands to vLLM, which resolves it in
    every rank."""
    global CpuDeviceCommunicator
    if CpuDeviceCommunicator is None:
        CpuDeviceCommunicator = _communicator_class()
    return f"{__name__}.CpuDeviceCommunicator"
