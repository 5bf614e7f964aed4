"""The Blackwell (SM100) seam for vLLM's NVFP4-oracle MoE design (vLLM 0.14.0+; read on 0.34.0).

Like :mod:`.blackwell` (the 0.11.x seam), nothing here is used by ``register()``. Tests and the
``matrix`` command enter :func:`simulated_blackwell` to run vLLM's *own* NVFP4 MoE code on a CPU:
its quant methods, ``FusedMoEFactory`` / ``RoutedExperts`` / ``MoERunner``, the weight loader,
``process_weights_after_loading`` (where the backend oracle picks ``FLASHINFER_CUTLASS`` and the
modular kernel is built), the prepare/finalize classes and ``FlashInferExperts``. Every
replacement stands in for hardware, or for a CUDA-only package (FlashInfer 0.7.3, ``vllm._C``),
and nothing else. Selected by :func:`applies` (the oracle module exists), never by a version
string; the same seam also runs vLLM 0.20.0 and 0.28.0 (their differing entry points are
replaced only where present). Citations: ``v0.34.0 path:line`` (paths under ``vllm/``; FM =
model_executor/layers/fused_moe, Q = model_executor/layers/quantization) and ``fi 0.6.18
path:line``: FlashInfer's source at its 0.6.18 version commit, the newest in the source mirror
read (no 0.7.x tag there). vLLM 0.34.0 pins FlashInfer 0.7.3, which is not on the package index,
so its NVFP4 ``cutlass_fused_moe`` contract is taken from 0.6.18 and from how vLLM 0.34.0 calls it
(FM/experts/flashinfer_cutlass_moe.py:252-393).

=====================================================  ===========================================
vLLM 0.34.0 symbol replaced                            why it has to be replaced on CPU
=====================================================  ===========================================
``type(current_platform).get_device_capability``       capability probe: reports SM100 (10, 0), so
                                                       ``_supports_quant_scheme`` (v0.34.0
                                                       FM/experts/flashinfer_cutlass_moe.py:153-
                                                       189) sees NVFP4 support; ``is_cuda()`` stays
                                                       False everywhere else
``FlashInferExperts._supports_current_device``        capability probe (:135-146): keeps the SM100
                                                       and FlashInfer checks, drops ``is_cuda()``
``flashinfer_cutlass_moe.has_flashinfer_cutlass_``     FlashInfer is not installed (0.7.3 is not on
``fused_moe``                                          the index); its kernel is emulated below
``flashinfer_cutlass_moe.flashinfer_cutlass_fused_``   FlashInfer kernel -> :func:`nvfp4.cutlass_
``moe``                                                fused_moe` (same six NVFP4 scales, fi 0.6.18
                                                       csrc/fused_moe/cutlass_backend/flashinfer_
                                                       cutlass_fused_moe_binding.cu:1367-1398)
``flashinfer_cutlass_moe.activation_to_flashinfer_``   imports ``flashinfer.fused_moe.core.Activa
``type``                                               tionType``; a twin of that enum (fi 0.6.18
                                                       flashinfer/tllm_enums.py:68-80)
``vllm._custom_ops.scaled_fp4_quant``                  vLLM's CUDA op ``_C.scaled_fp4_quant`` ->
                                                       the emulated quantizer (reads element 0 of
                                                       the global-scale vector, like the kernel)
``naive_dp_ep.nvfp4_block_scale_interleave``, same in  FlashInfer SF interleave -> emulator
``flashinfer_nvlink_two_sided`` / ``_one_sided``
``flashinfer_fp4_moe.swizzle_blockscale``              ends in ``.cuda()`` (v0.34.0 Q/utils/nvfp4_
                                                       utils.py:53); CPU twin of the layout
``type(current_platform).get_device_communicator_``    the platform's communicator is the no-op
``cls``                                                base class; :class:`CpuDeviceCommunicator`
                                                       is cuda_communicator.py's MoE half on gloo:
                                                       vLLM's own ``AgRsAll2AllManager`` for
                                                       ``allgather_reducescatter`` (v0.34.0
                                                       distributed/device_communicators/all2all.py
                                                       :57-202) over CPU ``all_gatherv`` /
                                                       ``reduce_scatterv``
``flashinfer_nvlink_two_sided.flashinfer_alltoall_``  0.20.0/0.28.0 only (older MnnvlMoe
``dispatch`` / ``_combine``                            contract): the same quantize-on-sender +
                                                       gloo transport
``sys.modules["flashinfer.fused_moe.core"]``           0.20.0 only, and only while FlashInfer is
                                                       not installed: ``FlashInferExperts.apply``
                                                       imports ``ActivationType`` from it; a module
                                                       holding only the enum twin
FlashInfer NVLink two-sided / one-sided managers       MNNVL needs NVLink: the managers
(all2all.py:676-765, :766-930)                         (``FlashInferNVLink*Manager``) are twinned
                                                       by :class:`_GlooAllToAll`, with the same
                                                       ``dispatch``/``combine`` contract; vLLM's
                                                       P/F still quantizes on the SENDER
                                                       (flashinfer_nvlink_two_sided.py:150-173,
                                                       _one_sided.py:126-147)
``all2all_utils.flashinfer_one_sided_dispatch_``       imports FlashInfer's ``QuantFormat``; NVFP4
``layout``                                             payload only, a stand-in enum
``torch.accelerator.current_device_index``,            the two-sided manager asks for a device;
``torch.accelerator.empty_cache``                      0.28.0's workspace manager frees its cache
=====================================================  ===========================================

What changed against the 0.11.x seam: activations are quantized by vLLM's own op
(``ops.scaled_fp4_quant``), not ``flashinfer.fp4_quantize``; against 0.3.1, ``cutlass_fused_moe``
gained
``swizzled_input_sf`` (default True, which vLLM relies on), ``use_packed_weights``,
``use_wfp4afp8_humming``, ``use_fused_finalize``, ``profile_ids``, ``workspace_buffer``,
``situ_beta``/``situ_linear_beta`` (fi 0.6.18 flashinfer/fused_moe/core.py:1180-1217); the NVFP4
operands (six scales, act scales scalar or one per local expert, block scales as int32 views)
are unchanged, so the 0.3.1 emulator is reused behind :func:`_fi_cutlass_fused_moe`.

With ``backend="latency"`` (``--moe-backend flashinfer_trtllm``, vLLM's first choice on SM100,
oracle/nvfp4.py:238-247) the seam also replaces, for its duration:

=====================================================  ===========================================
vLLM 0.34.0 / FlashInfer symbol replaced               why it has to be replaced on CPU
=====================================================  ===========================================
``TrtLlmNvFp4ExpertsBase._supports_current_device``    capability probe (FM/experts/trtllm_nvfp4_
                                                       moe.py:226-234): keeps SM100, drops
                                                       ``is_cuda()`` and the FlashInfer probe
``flashinfer.fused_moe.trtllm_fp4_block_scale_moe``    SM100 kernels (monolithic :601-634, modular
``flashinfer.fused_moe.trtllm_fp4_block_scale_``       :388-423) -> ``nvfp4.trtllm_emulator``'s
``routed_moe``                                         0.7 contract (``..._moe_0_7``,
                                                       ``..._routed_moe_0_7``)
``flashinfer.nvfp4_block_scale_interleave``            SF interleave at weight preparation
                                                       (Q/utils/flashinfer_fp4_moe.py:416-433)
                                                       -> the CPU twin of the 128x4 layout
``flashinfer.fused_moe.core._maybe_get_cached_w3_``    row-permutation indices of the TRT-LLM
``w1_permute_indices``, ``get_w2_permute_indices_``    shuffles (:367-390; fi 0.6.18 flashinfer/
``with_cache``                                         fused_moe/core.py:417-483) -> the same
                                                       indices from ``nvfp4.trtllm_layout``
``flashinfer.fused_moe.core.ActivationType``           :class:`ActivationType` twin
=====================================================  ===========================================

FlashInfer is not installed in that virtualenv, so these are a stand-in module tree
(:func:`_flashinfer_trtllm_stub`); vLLM's own weight preparation (``reorder_w1w3_to_w3w1``,
``align_fp4_moe_*``, ``prepare_static_weights_for_trtllm_fp4_moe``), quant config, prepare/
finalize and experts classes run unchanged. The activations are quantized by vLLM's
``scaled_fp4_quant`` in the LINEAR SF layout the TRT-LLM kernel reads (``is_scale_swizzled``
False, oracle/nvfp4.py:588-597).
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import importlib.util
import sys
from types import SimpleNamespace
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist

from fp4_moe_lab import nvfp4
from fp4_moe_lab.simulation.blackwell import (
    _as_bytes,
    _cpu_all_gatherv,
    _cpu_reduce_scatterv,
    _Patcher,
    cpu_swizzle_blockscale,
)

_FM = "vllm.model_executor.layers.fused_moe"
_FX = f"{_FM}.experts.flashinfer_cutlass_moe"
_ORACLE = f"{_FM}.oracle.nvfp4"


def applies() -> bool:
    """Feature probe: vLLM has the NVFP4 backend oracle (``fused_moe/oracle/nvfp4.py``)."""
    try:
        return importlib.util.find_spec(_ORACLE) is not None
    except ImportError:
        return False


def _experts_module():
    """Where ``FlashInferExperts`` lives: ``fused_moe/experts/`` (0.28.0+) or
    ``fused_moe/`` (v0.20.0 FM/flashinfer_cutlass_moe.py)."""
    for name in (_FX, f"{_FM}.flashinfer_cutlass_moe"):
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    raise ImportError("no FlashInferExperts module in this vLLM")


def _flashinfer_enum_stub():
    """v0.20.0 ``FlashInferExperts.apply`` imports ``flashinfer.fused_moe.core.ActivationType``
    itself (FM/flashinfer_cutlass_moe.py:262). Without FlashInfer installed, the seam provides
    that one module with only the :class:`ActivationType` twin, for the seam's duration."""
    import importlib.machinery
    import types

    mods = {}
    for name in ("flashinfer", "flashinfer.fused_moe", "flashinfer.fused_moe.core"):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mods[name] = m
    mods["flashinfer.fused_moe.core"].ActivationType = ActivationType
    return mods


def simulates_one_sided() -> bool:
    """Does this vLLM's one-sided NVLink manager hand out a ``moe_ep`` communication
    (``get_communication``, v0.34.0 distributed/device_communicators/all2all.py:895), the
    contract :class:`_GlooAllToAll` twins? 0.28.0's speaks FlashInfer's older payload-list
    ``moe_alltoall`` API instead
    (v0.28.0 prepare_finalize/flashinfer_nvlink_one_sided.py:117-124), which is not simulated."""
    try:
        from vllm.distributed.device_communicators.all2all import FlashInferNVLinkOneSidedManager
    except ImportError:
        return False
    return hasattr(FlashInferNVLinkOneSidedManager, "get_communication")


def simulates_trtllm() -> bool:
    """Does this vLLM have the TRT-LLM NVFP4 experts module the ``backend="latency"`` seam
    patches (``fused_moe/experts/trtllm_nvfp4_moe.py``, read on v0.34.0)? v0.20.0 keeps its
    experts under ``fused_moe/`` (see :func:`_experts_module`): no TRT-LLM simulation there."""
    try:
        return importlib.util.find_spec(_TRT) is not None
    except ImportError:
        return False


class ActivationType(enum.IntEnum):
    """Twin of FlashInfer's ``ActivationType`` (fi 0.6.18 flashinfer/tllm_enums.py:68-80)."""

    Gelu = 0
    Relu = 1
    Silu = 2
    Swiglu = 3
    Geglu = 4
    SwigluBias = 5
    Relu2 = 6
    SwigluStep = 7
    GegluTanh = 8
    Identity = 9
    Situ = 10
    InvalidType = 11


def _activation_to_flashinfer_type(activation) -> ActivationType:
    """v0.34.0 Q/utils/flashinfer_utils.py:39-70 for the one activation the emulator covers."""
    if getattr(activation, "name", None) != "SILU":
        raise NotImplementedError(f"emulator covers SiLU (SwiGLU) only, not {activation!r}")
    return ActivationType.Swiglu


def _fi_cutlass_fused_moe(*, activation_type=ActivationType.Swiglu,
                          swizzled_input_sf: bool = True, use_packed_weights: bool = False,
                          use_wfp4afp8_humming: bool = False, **kwargs):
    """FlashInfer 0.7.3 ``cutlass_fused_moe`` (fi 0.6.18 flashinfer/fused_moe/core.py:1180-1217)
    for NVFP4 + SwiGLU, on the emulator. Anything the emulator does not model is refused."""
    if activation_type != ActivationType.Swiglu:
        raise NotImplementedError(f"emulator covers SwiGLU only, not {activation_type!r}")
    if not swizzled_input_sf or use_packed_weights or use_wfp4afp8_humming:
        raise NotImplementedError("linear input SF, packed weights and the Humming path are "
                                  "not emulated")
    kwargs.pop("use_fused_finalize", None)  # a kernel-fusion choice; the result is the same
    return _KERNEL["cutlass"](**kwargs)


# What ``_fi_cutlass_fused_moe`` runs: the emulator, or (``simulated_blackwell(kernel=
# "reference")``) the ideal-NVFP4 loop of :mod:`.reference_kernel`.
_KERNEL = {"cutlass": nvfp4.cutlass_fused_moe}


class QuantFormat(enum.Enum):
    """Stand-in for ``flashinfer.fused_moe.QuantFormat`` (FlashInfer 0.7.x; not in the 0.6.18
    source read). vLLM only passes it through to the one-sided communication as the payload
    format; the gloo twin moves bytes whatever their format."""

    NVFP4 = "nvfp4"


def _one_sided_dispatch_layout(hidden_dim: int, quant_config, input_dtype=None):
    """v0.34.0 FM/all2all_utils.py:56-104 for NVFP4 dispatch, the case simulated; the import
    of FlashInfer's enum (:68) is what cannot run here."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import FlashInferOneSidedDispatchLayout

    if input_dtype is not None or quant_config.quant_dtype != "nvfp4":
        raise NotImplementedError("the one-sided twin covers NVFP4 dispatch only")
    return FlashInferOneSidedDispatchLayout(QuantFormat.NVFP4)


def _cpu_scaled_fp4_quant(input: torch.Tensor, input_global_scale: torch.Tensor,
                          is_sf_swizzled_layout: bool = True, backend: str = "none",
                          padded_n: Optional[int] = None):
    """``vllm._custom_ops.scaled_fp4_quant`` (v0.34.0 _custom_ops.py:1470-1545) on CPU.

    The CUDA kernel reads ``SFScale[0]`` of the global-scale tensor (vLLM csrc
    quantization/fp4/nvfp4_quant_kernels.cu, not shipped in the wheel); so does the emulated
    quantizer. Scales come back as float8_e4m3fn: ``[pad128(m), pad4(n/16)]`` swizzled or
    ``[m, n/16]`` linear (create_fp4_scale_tensor, :34-63)."""
    if "trtllm" in backend or padded_n is not None:
        raise NotImplementedError("the 8x4 TRT-LLM SF layout and K padding are not emulated")
    n = input.shape[-1]
    x = input.reshape(-1, n)
    q, sf = nvfp4.fp4_quantize(x, input_global_scale, 16, False, is_sf_swizzled_layout)
    if is_sf_swizzled_layout:
        sf = sf.reshape(-1, ((n // 16 + 3) // 4) * 4)
    else:
        sf = sf.reshape(x.shape[0], n // 16)
    return q, sf.view(torch.float8_e4m3fn)


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
                 runtime_max_tokens_per_rank: Optional[int] = None):
        rows = runtime_max_tokens_per_rank or hidden_states.shape[0]
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


def _mnnvl_alltoall_dispatch(all2all_manager, global_num_tokens_cpu, x, gs, topk_ids,
                             topk_weights, top_k, num_experts, quant_config,
                             defer_input_quant: bool = False):
    """The older two-sided contract (v0.28.0 prepare_finalize/flashinfer_nvlink_two_sided.py:
    125-215, same in v0.20.0: FlashInfer's ``MnnvlMoe`` alltoallv), MNNVL swapped for a gloo
    all-gather: the sender quantizes with ``gs`` in linear SF layout (:166-178), the receiver
    interleaves; the
    kernel skips the experts it does not own, so every rank computes what a real all-to-all
    would hand it. The 0.34.0 form (``moe_ep`` communications) is :class:`_GlooAllToAll`."""
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input

    if defer_input_quant:
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


def _mnnvl_alltoall_combine(all2all_manager, output, top_k, token_count, alltoall_info):
    """v0.28.0 flashinfer_nvlink_two_sided.py:218-240 over gloo: sum onto the sending rank."""
    return alltoall_info.combine(output)


def _two_sided_is_mnnvl() -> bool:
    """0.20.0/0.28.0's two-sided P/F calls module functions with (..., top_k, num_experts,
    ...); 0.34.0's takes a ``moe_ep`` communication instead."""
    import inspect

    mod = importlib.import_module(f"{_FM}.prepare_finalize.flashinfer_nvlink_two_sided")
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
                self.all2all_manager = _gloo_nvlink_managers()[0](self.cpu_group)
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

        def dispatch(self, hidden_states, topk_weights, topk_ids, is_sequence_parallel=False,
                     extra_tensors=None):
            return self.all2all_manager.dispatch(hidden_states, topk_weights, topk_ids,
                                                 is_sequence_parallel,
                                                 extra_tensors=extra_tensors)

        def combine(self, hidden_states, is_sequence_parallel=False):
            return self.all2all_manager.combine(hidden_states, is_sequence_parallel)

        def allocate_combine_input(self, shape, dtype, device, is_sequence_parallel=False):
            return None

        def combine_into_output(self, hidden_states, output, is_sequence_parallel=False):
            output.copy_(self.combine(hidden_states, is_sequence_parallel))
            return output

    return CpuDeviceCommunicator


CpuDeviceCommunicator = None  # built lazily (needs vLLM); see _communicator_class


def _sm100():
    from vllm.platforms.interface import DeviceCapability

    return classmethod(lambda cls, device_id=0: DeviceCapability(10, 0))


class _ClassPatcher(_Patcher):
    """Sets class attributes and restores the class's own ``__dict__`` entry (or its absence),
    so a classmethod inherited from a base class is not left behind as a bound method."""

    _MISSING = object()

    def set_cls(self, cls: type, attr: str, value: Any) -> None:
        old = cls.__dict__.get(attr, self._MISSING)
        self._undo.append((cls, attr, old))
        setattr(cls, attr, value)

    def undo(self) -> None:
        while self._undo:
            owner, attr, value = self._undo.pop()
            if value is self._MISSING:
                delattr(owner, attr)
            else:
                setattr(owner, attr, value)


def _fi_cutlass_supports_current_device() -> bool:
    """v0.34.0 FM/experts/flashinfer_cutlass_moe.py:135-146 without ``is_cuda()``."""
    from vllm.platforms import current_platform as p

    return p.is_device_capability_family(100)


# --- FlashInfer TRT-LLM ("latency", ``--moe-backend flashinfer_trtllm``) ---------------------
_TRT = f"{_FM}.experts.trtllm_nvfp4_moe"


def _w3_w1_permute_indices(cache, dst_w3_w1_weight: torch.Tensor, epilogue_tile_m: int,
                           num_elts_per_sf=None, is_gated_act_gemm: bool = True) -> torch.Tensor:
    """Stand-in for FlashInfer's ``_maybe_get_cached_w3_w1_permute_indices`` (fi 0.6.18
    flashinfer/fused_moe/core.py:417-453): row ``i`` of the kernel's GEMM1 matrix is row
    ``src[i]`` of ``[w3; w1]`` -- the gated-activation interleave chained with the 32-row
    ``shuffle_matrix_a`` block permutation, the same for weights and linear block scales
    (``get_shuffle_matrix_sf_a_row_indices`` permutes whole rows too). FlashInfer computes it
    with device kernels; :mod:`nvfp4.trtllm_layout` computes the same indices on CPU (checked
    byte for byte against FlashInfer 0.3.1's shuffles in tests/nvfp4, and against FlashInfer
    0.7.2.post1's and 0.7.4's own helpers in tests/newest/test_newest_trtllm_layout.py)."""
    from fp4_moe_lab.nvfp4 import trtllm_layout as tl

    rows = dst_w3_w1_weight.shape[0]
    key = ("w3_w1", tuple(dst_w3_w1_weight.shape), epilogue_tile_m, num_elts_per_sf,
           is_gated_act_gemm)
    if key not in cache:
        cache[key] = (tl.gemm1_row_sources(rows, epilogue_tile_m) if is_gated_act_gemm
                      else tl.shuffle_row_sources(rows, epilogue_tile_m))
    return cache[key]


def _w2_permute_indices(cache, dst_w2_weight: torch.Tensor, epilogue_tile_m: int,
                        num_elts_per_sf=None) -> torch.Tensor:
    """Stand-in for ``get_w2_permute_indices_with_cache`` (fi 0.6.18 flashinfer/fused_moe/
    core.py:456-483): the ``shuffle_matrix_a`` row permutation alone."""
    from fp4_moe_lab.nvfp4 import trtllm_layout as tl

    key = ("w2", tuple(dst_w2_weight.shape), epilogue_tile_m, num_elts_per_sf)
    if key not in cache:
        cache[key] = tl.shuffle_row_sources(dst_w2_weight.shape[0], epilogue_tile_m)
    return cache[key]


def _flashinfer_trtllm_stub():
    """The FlashInfer names vLLM 0.34.0's TRT-LLM NVFP4 path imports at call time, as a module
    tree installed for the seam's duration (FlashInfer 0.7.3 is not installable here):
    ``flashinfer.nvfp4_block_scale_interleave`` and the two permute-index helpers
    (Q/utils/flashinfer_fp4_moe.py:338-342, weight preparation), ``flashinfer.fused_moe.
    trtllm_fp4_block_scale_moe`` / ``trtllm_fp4_block_scale_routed_moe`` (FM/experts/
    trtllm_nvfp4_moe.py:388, 601: the kernels, -> the 0.7 emulator) and ``flashinfer.fused_moe.
    core.ActivationType`` (Q/utils/flashinfer_utils.py:39-40)."""
    import importlib.machinery
    import types

    from fp4_moe_lab.nvfp4 import trtllm_emulator as te

    mods = {}
    for name in ("flashinfer", "flashinfer.fused_moe", "flashinfer.fused_moe.core"):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mods[name] = m
    fi, fm, core = (mods["flashinfer"], mods["flashinfer.fused_moe"],
                    mods["flashinfer.fused_moe.core"])
    fi.fused_moe, fm.core = fm, core
    fi.nvfp4_block_scale_interleave = nvfp4.block_scale_interleave
    fm.trtllm_fp4_block_scale_moe = te.trtllm_fp4_block_scale_moe_0_7
    fm.trtllm_fp4_block_scale_routed_moe = te.trtllm_fp4_block_scale_routed_moe_0_7
    core.ActivationType = ActivationType
    core._maybe_get_cached_w3_w1_permute_indices = _w3_w1_permute_indices
    core.get_w2_permute_indices_with_cache = _w2_permute_indices
    return mods


def _trtllm_supports_current_device() -> bool:
    """v0.34.0 FM/experts/trtllm_nvfp4_moe.py:226-234 without ``is_cuda()`` and the FlashInfer
    probe (its kernels are the emulator's)."""
    from vllm.platforms import current_platform as p

    return p.is_device_capability_family(100)


@contextlib.contextmanager
def simulated_blackwell(*, backend: str = "throughput",
                        kernel: str = "emulator") -> Iterator[None]:
    """Run vLLM's oracle-design NVFP4 MoE code on CPU with the emulator as FlashInfer.

    The backend is chosen the way a user does it, ``--moe-backend flashinfer_cutlass``
    (``KernelConfig.moe_backend``; see :data:`MOE_BACKENDS`): ``backend="throughput"``
    (CUTLASS) or ``"latency"`` (TRT-LLM: also its kernels, weight-shuffle helpers and device
    probe, see :func:`_flashinfer_trtllm_stub`). ``kernel="reference"`` (CUTLASS only): the
    ideal-NVFP4 loop of :mod:`.reference_kernel` instead of the emulator, for end-to-end
    references (run them with the plugin on: :func:`.reference_kernel.
    reference_cutlass_fused_moe_prequantized` says why)."""
    global CpuDeviceCommunicator
    if backend not in MOE_BACKENDS or kernel not in ("emulator", "reference"):
        raise NotImplementedError("the oracle seam simulates FlashInfer CUTLASS and TRT-LLM "
                                  "with the emulator, and CUTLASS with the reference kernel")
    if kernel == "reference" and backend != "throughput":
        raise NotImplementedError("the reference kernel stands in for FlashInfer CUTLASS only")
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    if CpuDeviceCommunicator is None:
        CpuDeviceCommunicator = _communicator_class()
    platform_cls = type(current_platform)
    p = _ClassPatcher()
    stubbed: list[str] = []
    try:
        p.set_cls(platform_cls, "get_device_capability", _sm100())
        p.set_cls(platform_cls, "get_device_communicator_cls",
                  classmethod(lambda cls: f"{__name__}.CpuDeviceCommunicator"))
        fx = _experts_module()
        p.set_cls(fx.FlashInferExperts, "_supports_current_device",
                  staticmethod(_fi_cutlass_supports_current_device))
        p.set(fx, "has_flashinfer_cutlass_fused_moe", lambda: True)
        p.set(fx, "flashinfer_cutlass_fused_moe", _fi_cutlass_fused_moe)
        if kernel == "reference":
            from fp4_moe_lab.simulation.reference_kernel import (
                reference_cutlass_fused_moe_prequantized,
            )

            p.set(sys.modules[__name__], "_KERNEL",
                  {"cutlass": reference_cutlass_fused_moe_prequantized})
        p.set(fx, "activation_to_flashinfer_type", _activation_to_flashinfer_type,
              only_if_present=True)  # 0.28.0+; 0.20.0 imports FlashInfer's enum in apply
        if (not hasattr(fx, "activation_to_flashinfer_type")
                and importlib.util.find_spec("flashinfer") is None):
            for name, mod in _flashinfer_enum_stub().items():
                stubbed.append(name)
                sys.modules[name] = mod
        p.set(ops, "scaled_fp4_quant", _cpu_scaled_fp4_quant)
        for mod in (f"{_FM}.prepare_finalize.naive_dp_ep",
                    f"{_FM}.prepare_finalize.flashinfer_nvlink_two_sided",
                    f"{_FM}.prepare_finalize.flashinfer_nvlink_one_sided"):
            p.set(mod, "nvfp4_block_scale_interleave", nvfp4.block_scale_interleave,
                  only_if_present=True)
        p.set("vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe",
              "swizzle_blockscale", cpu_swizzle_blockscale)
        if _two_sided_is_mnnvl():  # 0.28.0
            two = f"{_FM}.prepare_finalize.flashinfer_nvlink_two_sided"
            p.set(two, "flashinfer_alltoall_dispatch", _mnnvl_alltoall_dispatch)
            p.set(two, "flashinfer_alltoall_combine", _mnnvl_alltoall_combine)
        p.set(f"{_FM}.all2all_utils", "flashinfer_one_sided_dispatch_layout",
              _one_sided_dispatch_layout, only_if_present=True)  # not in 0.28.0
        p.set(torch.accelerator, "current_device_index", lambda: 0)
        if backend == "latency":
            if importlib.util.find_spec("flashinfer") is not None:
                raise NotImplementedError("the TRT-LLM seam stands in for FlashInfer only "
                                          "where it is not installed")
            trt = importlib.import_module(_TRT)
            p.set_cls(trt.TrtLlmNvFp4ExpertsBase, "_supports_current_device",
                      staticmethod(_trtllm_supports_current_device))
            for name, mod in _flashinfer_trtllm_stub().items():
                stubbed.append(name)
                sys.modules[name] = mod
        # 0.28.0's workspace manager empties the device cache when it grows (v0.28.0
        # v1/worker/workspace.py:206); there is no device cache on CPU.
        p.set(torch.accelerator, "empty_cache", lambda: None, only_if_present=True)
        yield
    finally:
        p.undo()
        for name in stubbed:
            sys.modules.pop(name, None)


MOE_BACKEND = "flashinfer_cutlass"  # KernelConfig.moe_backend the layouts ask for
#: seam backend -> the ``--moe-backend`` (KernelConfig.moe_backend) a user picks it with
MOE_BACKENDS = {"throughput": MOE_BACKEND, "latency": "flashinfer_trtllm"}
