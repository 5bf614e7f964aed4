# SPDX-License-Identifier: Apache-2.0
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
``type(current_platform).get_device_capability``       capability probe: reports the simulated
                                                       GPU (``capability``, default 10.0, see
                                                       :data:`.gpus.CAPABILITIES`), so every
                                                       ``has_``/``is_device_capability[_family]``
                                                       of vLLM
                                                       answers as on that GPU (platforms/
                                                       interface.py:541-598 read only this);
                                                       ``is_cuda()`` stays False everywhere else
``fused_moe.config.current_platform``                 ``FusedMoEConfig`` refuses non-gated experts
                                                       (``is_act_and_mul=False``) off CUDA, XPU
                                                       and ROCm (FM/config.py:1456-1461): the
                                                       module sees a platform that answers
                                                       ``is_cuda_alike()`` as the GPU would, the
                                                       rest delegated to the real one
``FlashInferExperts._supports_current_device``        capability probe (:134-146): keeps its
                                                       family checks (9.0, 10.x, 12.x) and the
                                                       FlashInfer check, drops ``is_cuda()``
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
                                                       by ``oracle_comm._GlooAllToAll``, same
                                                       ``dispatch``/``combine`` contract; vLLM's
                                                       P/F still quantizes on the SENDER
                                                       (flashinfer_nvlink_two_sided.py:150-173,
                                                       _one_sided.py:126-147)
``all2all_utils.flashinfer_one_sided_dispatch_``       imports FlashInfer's ``QuantFormat``; NVFP4
``layout``                                             payload only, a stand-in enum
``torch.accelerator.current_device_index``,            vLLM allocates on it (v0.18.0's DP-chunking
``torch.accelerator.empty_cache``                      buffers): the CPU; 0.28.0's workspace
                                                       manager frees its device cache
=====================================================  ===========================================

GPU families (``capability``, :data:`.gpus.CAPABILITIES`): the seam reports 10.0 (B200), 10.3
(B300), 12.0 (RTX PRO 6000) or 12.1 (GB10) and changes nothing else per family. vLLM's own code
then decides, as on that GPU: an explicit ``--moe-backend`` goes to ``oracle.return_or_raise``
(FM/oracle/nvfp4.py:298, FM/oracle/base.py:218-238), which asks the experts'
``is_supported_config`` and with it ``_supports_current_device`` (FM/modular_kernel.py:650) and
``_supports_quant_scheme``; a refusal is a ``ValueError`` the matrix records as ``vllm_refuses``
(``layouts.refusal``). So TRT-LLM (10.x only) is refused on 12.x, and FlashInfer CUTLASS (9.0,
10.x, 12.x; NVFP4 from ``has_device_capability(100)``, :184-189) is built on all four. The emulated
CUTLASS kernel is the same on every family: FlashInfer's Python ``cutlass_fused_moe`` takes the
same NVFP4 operands whatever arch its JIT module was built for, and the GEMM1 scale collapse
happens in vLLM's Python before the kernel, with no capability question
(Q/utils/flashinfer_fp4_moe.py:496-504, FM/oracle/nvfp4.py:78-83). Arch-specific kernel numerics
(SM120 CUTLASS tiles) are not emulated. Non-default capabilities need the experts' own
``_supports_current_device``, found by feature; their family rules were read on v0.34.0 only
(where 0.20.0 and 0.28.0 take this branch, the seam answers with 0.34.0's rule, unread and
unmeasured per family there). On v0.14.0's module-level probes only 10.0 is modelled.

What changed against the 0.11.x seam: activations are quantized by vLLM's own op
(``ops.scaled_fp4_quant``), not ``flashinfer.fp4_quantize``; against 0.3.1, ``cutlass_fused_moe``
gained
``swizzled_input_sf`` (default True, which vLLM relies on), ``use_packed_weights``,
``use_wfp4afp8_humming``, ``use_fused_finalize``, ``profile_ids``, ``workspace_buffer``,
``situ_beta``/``situ_linear_beta`` (fi 0.6.18 flashinfer/fused_moe/core.py:1180-1217); the NVFP4
operands (six scales, act scales scalar or one per local expert, block scales as int32 views)
are unchanged, so the 0.3.1 emulator is reused behind
:func:`.oracle_flashinfer.fi_cutlass_fused_moe`.

vLLM 0.14.0, the oracle design's first release, still has the older layer around the oracle
(``FusedMoE`` with DP chunking, the FlashInfer P/Fs in one module, no ``fused_moe/experts/`` or
``prepare_finalize/`` package; FlashInfer 0.5.3 pinned, whose ``cutlass_fused_moe`` NVFP4
operands are those above). Found by feature, never by version, the seam also replaces there
(paths under ``vllm/`` of v0.14.0):

=====================================================  ===========================================
vLLM 0.14.0 symbol replaced                            why it has to be replaced on CPU
=====================================================  ===========================================
``oracle.nvfp4.cutlass_fp4_supported``                 capability probe (Q/utils/quant_utils.py:
                                                       714-719: ``is_cuda()`` + a CUDA op): SM100?
``oracle.nvfp4.is_flashinfer_fp4_cutlass_moe_``        capability probe (Q/utils/flashinfer_fp4_
``available``, same in ``flashinfer_fp4_moe``          moe.py:51-58): keeps the env and SM100
                                                       checks, drops ``is_cuda()``
``fused_moe.config.has_flashinfer_cutlass_fused_moe``  FlashInfer is not installed; FM/config.py:
                                                       1103-1111 decides DP chunking with it
``fused_moe.utils.flashinfer_fp4_quantize``            FlashInfer's quantizer (FM/utils.py:115-
                                                       122) -> the emulated ``fp4_quantize``
``flashinfer_cutlass_prepare_finalize.nvfp4_block_``   FlashInfer SF interleave (:20) -> emulator
``scale_interleave``
``flashinfer_cutlass_prepare_finalize.flashinfer_``    MNNVL all-to-all (:249-348) -> the gloo twin
``alltoall_dispatch`` / ``_combine``                   of the 0.20.0/0.28.0 two-sided contract
``FlashInferAllToAllManager`` (in the communicator)    asserts FlashInfer (distributed/device_
                                                       communicators/all2all.py:418-421); twinned
                                                       without the MNNVL workspace
``torch.cuda.current_device``                          FM/layer.py:1527-1551 allocates the DP
                                                       chunking buffers on it
``sys.modules["flashinfer.fused_moe.core"]``           ``FlashInferExperts.apply`` imports
                                                       ``ActivationType`` (FM/flashinfer_cutlass_
                                                       moe.py:152), as on 0.20.0
=====================================================  ===========================================

Its FlashInfer TRT-LLM path and the one-sided dispatcher are not simulated (see
:func:`.oracle_trtllm.simulates_trtllm` and :func:`simulates_one_sided`).

vLLM 0.16.0 has dropped v0.14.0's ``flashinfer_cutlass_prepare_finalize.py`` but has no
``prepare_finalize/`` package yet: the DP P/Fs are the plain module ``fused_moe/
prepare_finalize.py`` (naive all-gather/reduce-scatter, for ``dp`` and ``dp_ep_allgather``) and
``fused_moe/flashinfer_a2a_prepare_finalize.py`` (``flashinfer_all2allv``), each calling
FlashInfer through vLLM's lazy wrappers (utils/flashinfer.py:68-104, which raise "FlashInfer
backend is not available" when it is absent). Found by feature (the module exists and holds the
symbol), the seam also replaces there (paths under ``vllm/`` of v0.16.0):

=====================================================  ===========================================
vLLM 0.16.0 symbol replaced                            why it has to be replaced on CPU
=====================================================  ===========================================
``prepare_finalize.nvfp4_block_scale_interleave``      FlashInfer SF interleave after the gather
                                                       (FM/prepare_finalize.py:14, 100-104;
                                                       wrapper utils/flashinfer.py:131-133) ->
                                                       emulator
``flashinfer_a2a_prepare_finalize.flashinfer_``        ``flashinfer.comm.trtllm_alltoall.MnnvlMoe``
``alltoall_dispatch`` / ``_combine``                   (FM/flashinfer_a2a_prepare_finalize.py:
                                                       118-226; MNNVL, and the seam's stub
                                                       ``flashinfer`` is no package) -> the gloo
                                                       twin of the 0.14.0/0.20.0 two-sided
                                                       contract (an all-gather over the EP
                                                       group's gloo ``cpu_group``, a sum-all-
                                                       reduce for combine); the interleave at
                                                       :188-192 happens inside it
=====================================================  ===========================================

Its ``FlashInferAllToAllManager`` is v0.14.0's (distributed/device_communicators/all2all.py:
502-604) and is twinned the same way.

With ``backend="latency"`` (``--moe-backend flashinfer_trtllm``, vLLM's first choice on SM100,
oracle/nvfp4.py:238-247) the seam also replaces, for its duration:

=====================================================  ===========================================
vLLM 0.34.0 / FlashInfer symbol replaced               why it has to be replaced on CPU
=====================================================  ===========================================
``TrtLlmNvFp4ExpertsBase._supports_current_device``    capability probe (FM/experts/trtllm_nvfp4_
                                                       moe.py:226-234): keeps the 10.x family
                                                       check, drops ``is_cuda()`` and the
                                                       FlashInfer probe (so 12.x is refused)
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
``flashinfer.fused_moe.core.ActivationType``           ``oracle_flashinfer.ActivationType`` twin
``trtllm_nvfp4_moe.trtllm_moe_pack_topk_ids_weights``  v0.28.0's Triton kernel packing expert id
                                                       and bf16 weight into one int32 (FM/utils.
                                                       py:391-459) -> the same in torch
``trtllm_nvfp4_moe.flashinfer``                        v0.17.0's experts module imports
                                                       ``flashinfer`` at its top (:4) and calls
                                                       the kernels through it: -> this seam's tree
=====================================================  ===========================================

FlashInfer is not installed in that virtualenv, so these are a stand-in module tree
(:func:`.oracle_trtllm.flashinfer_trtllm_stub`); vLLM's own weight preparation
(``reorder_w1w3_to_w3w1``, ``align_fp4_moe_*``, ``prepare_static_weights_for_trtllm_fp4_moe``),
quant config, prepare/finalize and experts classes run unchanged. The activations are quantized
by vLLM's ``scaled_fp4_quant`` in the LINEAR SF layout the TRT-LLM kernel reads
(``is_scale_swizzled`` False, oracle/nvfp4.py:588-597).

With ``backend="vllm_cutlass"`` (``--moe-backend cutlass``: vLLM's own CUTLASS NVFP4 MoE,
``NvFp4MoeBackend.VLLM_CUTLASS``, FM/oracle/nvfp4.py:134-139, 179) the seam also replaces, for its
duration (stand-ins in :mod:`.oracle_vllm_cutlass`; vLLM's weight preparation, quant config,
prepare/finalize and ``run_cutlass_moe_fp4`` run unchanged; the weights' block scales go through
the ``swizzle_blockscale`` twin above, Q/utils/flashinfer_fp4_moe.py:547-563):

=====================================================  ===========================================
vLLM 0.34.0 symbol replaced                            why it has to be replaced on CPU
=====================================================  ===========================================
``CutlassExpertsFp4._supports_current_device``         capability probe (FM/experts/cutlass_moe.
                                                       py:723-730): keeps the 10.x and 12.x family
                                                       checks, drops ``is_cuda()``
``vllm._custom_ops.get_cutlass_moe_mm_data``           ``_C`` op (_custom_ops.py:838-891): per-
                                                       expert problem sizes, offsets, 128-row
                                                       padded block-scale offsets, permutations
``vllm._custom_ops.shuffle_rows``                      ``_moe_C`` op (:913-924): a row gather
``vllm._custom_ops.scaled_fp4_experts_quant``          ``_C`` op (:1548-1609): NVFP4 quantization
                                                       with each row's expert's global scale,
                                                       128x4 scales per expert block
``vllm._custom_ops.silu_and_mul_scaled_fp4_experts_``  ``_C`` op (:1612-1674): ``silu(gate) * up``
``quant``                                              in the input dtype, then the same
``vllm._custom_ops.cutlass_fp4_moe_mm``                ``_C.cutlass_fp4_group_mm`` (:1001-1037):
                                                       SM100/SM120 grouped block-scaled GEMM, one
                                                       alpha per expert
``cutlass_moe.remap_topk_to_local``                    Triton kernel (FM/utils.py:262-299) mapping
                                                       global expert ids to local ones under EP
=====================================================  ===========================================

and poisons memory nobody initialised, as a debugging allocator does: each view
``WorkspaceManager.get_simultaneous`` hands out (v1/worker/workspace.py:190-220; the MoE
workspaces, FM/modular_kernel.py:1266-1273) is filled with NaN first. Its callers may not rely on
what a view held (``get_retained`` is the one that keeps contents); on a GPU it holds the previous
layer's data, on CPU a fresh buffer is mostly zero pages, which would hide such a read. Only for
this backend: vLLM's CUTLASS Python hands its CUDA ops those workspaces directly.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from typing import Any, Iterator

import torch

from fp4_moe_lab import nvfp4
from fp4_moe_lab.simulation import (
    oracle_comm,
    oracle_flashinfer,
    oracle_trtllm,
    oracle_vllm_cutlass,
)
from fp4_moe_lab.simulation.blackwell import _Patcher, cpu_swizzle_blockscale
from fp4_moe_lab.simulation.gpus import DEFAULT_CAPABILITY, parse_capability

_FM = "vllm.model_executor.layers.fused_moe"
_FX = f"{_FM}.experts.flashinfer_cutlass_moe"
_ORACLE = f"{_FM}.oracle.nvfp4"


def applies() -> bool:
    """Feature probe: vLLM has the NVFP4 backend oracle (``fused_moe/oracle/nvfp4.py``)."""
    try:
        return importlib.util.find_spec(_ORACLE) is not None
    except ImportError:
        return False


def experts_module():
    """Where ``FlashInferExperts`` lives: ``fused_moe/experts/`` (0.28.0+) or
    ``fused_moe/`` (v0.20.0 FM/flashinfer_cutlass_moe.py)."""
    for name in (_FX, f"{_FM}.flashinfer_cutlass_moe"):
        # 0.14.x: no fused_moe/experts/; v0.20.0: one, without flashinfer_cutlass_moe.py
        mod = oracle_comm.present_module(name)
        if mod is not None:
            return mod
    raise ImportError("no FlashInferExperts module in this vLLM")


def simulates_one_sided() -> bool:
    """Does this vLLM's one-sided NVLink manager hand out a ``moe_ep`` communication
    (``get_communication``, v0.34.0 distributed/device_communicators/all2all.py:895), the
    contract ``oracle_comm._GlooAllToAll`` twins? 0.28.0's speaks FlashInfer's older payload-list
    ``moe_alltoall`` API instead
    (v0.28.0 prepare_finalize/flashinfer_nvlink_one_sided.py:117-124), which is not simulated.
    v0.14.0 has no one-sided dispatcher at all, so its ``dp_ep_one_sided`` row cannot exist:
    ``all2all_backend`` takes naive, pplx, deepep_*, allgather_reducescatter and
    flashinfer_all2allv only (v0.14.0 config/parallel.py:40-47; managers distributed/
    device_communicators/all2all.py:27-509, chosen in cuda_communicator.py:92-118)."""
    try:
        from vllm.distributed.device_communicators.all2all import FlashInferNVLinkOneSidedManager
    except ImportError:
        return False
    return hasattr(FlashInferNVLinkOneSidedManager, "get_communication")


# re-exported for callers that ask the seam what it simulates
simulates_trtllm = oracle_trtllm.simulates_trtllm


def _fi_fp4_cutlass_moe_available_0_14() -> bool:
    """v0.14.0 Q/utils/flashinfer_fp4_moe.py:51-58 without ``is_cuda()``; FlashInfer's kernel
    is the emulator (``has_flashinfer_cutlass_fused_moe``, as in the experts module)."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    return bool(envs.VLLM_USE_FLASHINFER_MOE_FP4 and current_platform.has_device_capability(100))


def _probes_0_14(p: _Patcher) -> None:
    """v0.14.0's capability probes, module functions rather than the experts' own
    ``_supports_current_device``: ``select_nvfp4_moe_backend`` (FM/oracle/nvfp4.py:80-111)
    asks ``cutlass_fp4_supported()`` (Q/utils/quant_utils.py:714-719: ``is_cuda()``, then the
    CUDA op ``cutlass_scaled_mm_supports_fp4``) and ``is_flashinfer_fp4_cutlass_moe_available()``
    (Q/utils/flashinfer_fp4_moe.py:51-58: ``is_cuda()``, SM100). Replaced where the oracle
    imported them by name; each keeps its SM100 question, through the reported capability."""
    from vllm.platforms import current_platform

    p.set(_ORACLE, "cutlass_fp4_supported",
          lambda: current_platform.has_device_capability(100), only_if_present=True)
    for owner in (_ORACLE, "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"):
        p.set(owner, "is_flashinfer_fp4_cutlass_moe_available",
              _fi_fp4_cutlass_moe_available_0_14, only_if_present=True)


class _CudaAlike:
    """The platform as ``FusedMoEConfig``'s non-gated check sees it on a GPU: CUDA-alike; every
    other attribute is the real platform's."""

    def __init__(self, real):
        self._real = real

    def is_cuda_alike(self) -> bool:
        return True

    def __getattr__(self, name):
        return getattr(self._real, name)


def _reported_capability(major: int, minor: int):
    """What ``get_device_capability`` answers: NVML's compute capability of GPU 0 on a real
    machine (v0.34.0 platforms/cuda.py:803-813), here the simulated GPU's."""
    from vllm.platforms.interface import DeviceCapability

    return classmethod(lambda cls, device_id=0: DeviceCapability(major, minor))


def simulates_capability(capability: str) -> bool:
    """Can the installed vLLM be run as GPU ``capability``? 10.0 always (both seams); the other
    families on an oracle release whose FlashInfer CUTLASS asks its own
    ``_supports_current_device`` (v0.34.0 FM/experts/flashinfer_cutlass_moe.py:134-146), whose
    family checks the seam keeps. v0.14.0's module-level probes (:func:`_probes_0_14`) and the
    0.11.x seam are modelled for SM100 only."""
    parse_capability(capability)
    if capability == DEFAULT_CAPABILITY:
        return True
    return applies() and hasattr(experts_module().FlashInferExperts, "_supports_current_device")


def _require_default_capability(capability: str) -> None:
    """v0.14.0's probes are modelled for SM100 only (their 12.x answers were not read)."""
    if capability != DEFAULT_CAPABILITY:
        raise NotImplementedError(f"capability {capability}: this vLLM's NVFP4 MoE probes "
                                  f"are simulated for {DEFAULT_CAPABILITY} only")


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


@contextlib.contextmanager
def simulated_blackwell(*, backend: str = "throughput", kernel: str = "emulator",
                        capability: str = DEFAULT_CAPABILITY) -> Iterator[None]:
    """Run vLLM's oracle-design NVFP4 MoE code on CPU with the emulator as FlashInfer.

    The backend is chosen the way a user does it, ``--moe-backend flashinfer_cutlass``
    (``KernelConfig.moe_backend``; see :data:`MOE_BACKENDS`): ``backend="throughput"``
    (CUTLASS) or ``"latency"`` (TRT-LLM: also its kernels, weight-shuffle helpers and device
    probe, see :func:`.oracle_trtllm.flashinfer_trtllm_stub`), or ``"auto"`` (both stand-ins,
    ``--moe-backend auto``: vLLM's oracle picks by its own order and device probes),
    ``"vllm_cutlass"`` (vLLM's own CUTLASS kernel, its CUDA ops emulated), or ``"b12x"`` /
    ``"flashinfer_b12x"`` (:data:`B12X_EXPERTS`: their device probes only, for what vLLM's
    selection refuses).
    ``kernel="reference"``
    (CUTLASS only): the ideal-NVFP4 loop of :mod:`.reference_kernel` instead of the emulator,
    for end-to-end references (run them with the plugin on:
    :func:`.reference_kernel.reference_cutlass_fused_moe_prequantized` says why).
    ``capability``: the GPU reported to vLLM, one of :data:`.gpus.CAPABILITIES` (module
    docstring, GPU families)."""
    if backend not in MOE_BACKENDS or kernel not in ("emulator", "reference"):
        raise NotImplementedError("the oracle seam simulates FlashInfer CUTLASS and TRT-LLM "
                                  "with the emulator, and CUTLASS with the reference kernel")
    if kernel == "reference" and backend != "throughput":
        raise NotImplementedError("the reference kernel stands in for FlashInfer CUTLASS only")
    major, minor = parse_capability(capability)
    import vllm._custom_ops as ops
    from vllm.platforms import current_platform

    communicator = oracle_comm.install_communicator()
    platform_cls = type(current_platform)
    p = _ClassPatcher()
    stubbed: list[str] = []
    # Asked once, before the seam puts any stand-in ``flashinfer`` into sys.modules (find_spec
    # answers from sys.modules first, so a later question would find the seam's own stub).
    flashinfer_absent = importlib.util.find_spec("flashinfer") is None

    def stub(mods: dict) -> None:  # a stand-in ``flashinfer`` tree, for the seam's duration
        for name, mod in mods.items():
            stubbed.append(name)
            sys.modules[name] = mod

    try:
        p.set_cls(platform_cls, "get_device_capability", _reported_capability(major, minor))
        p.set_cls(platform_cls, "get_device_communicator_cls",
                  classmethod(lambda cls: communicator))
        p.set(f"{_FM}.config", "current_platform", _CudaAlike(current_platform),
              only_if_present=True)
        fx = experts_module()
        if hasattr(fx.FlashInferExperts, "_supports_current_device"):  # e.g. 0.34.0
            p.set_cls(fx.FlashInferExperts, "_supports_current_device",
                      staticmethod(oracle_flashinfer.fi_cutlass_supports_current_device))
        else:  # v0.14.0: the oracle's module-level probes, see _probes_0_14
            _require_default_capability(capability)
            _probes_0_14(p)
        p.set(fx, "has_flashinfer_cutlass_fused_moe", lambda: True)
        # v0.14.0 FM/config.py:1103-1111 (FusedMoEConfig.use_flashinfer_cutlass_kernels, which
        # turns on the DP chunking of FM/layer.py:779-784) asks FlashInfer too; not in 0.34.0
        p.set(f"{_FM}.config", "has_flashinfer_cutlass_fused_moe", lambda: True,
              only_if_present=True)
        p.set(fx, "flashinfer_cutlass_fused_moe", oracle_flashinfer.fi_cutlass_fused_moe)
        if kernel == "reference":
            from fp4_moe_lab.simulation.reference_kernel import (
                reference_cutlass_fused_moe_prequantized,
            )

            p.set(oracle_flashinfer, "_KERNEL",
                  {"cutlass": reference_cutlass_fused_moe_prequantized})
        p.set(fx, "activation_to_flashinfer_type",
              oracle_flashinfer.activation_to_flashinfer_type,
              only_if_present=True)  # 0.28.0+; 0.20.0 imports FlashInfer's enum in apply
        if not hasattr(fx, "activation_to_flashinfer_type") and flashinfer_absent:
            stub(oracle_flashinfer.flashinfer_enum_stub())
        p.set(ops, "scaled_fp4_quant", oracle_flashinfer.cpu_scaled_fp4_quant)
        # v0.14.0 quantizes MoE activations with FlashInfer's quantizer, not vLLM's op
        # (FM/utils.py:27, 115-122: ``flashinfer_fp4_quantize``); 0.34.0 has no such name
        p.set(f"{_FM}.utils", "flashinfer_fp4_quantize", nvfp4.fp4_quantize,
              only_if_present=True)
        # the P/Fs' SF interleave: the prepare_finalize/ package (0.20.0+), v0.14.0's one
        # module for FlashInfer's P/Fs (FM/flashinfer_cutlass_prepare_finalize.py:20, 227, 314),
        # or v0.16.0's plain prepare_finalize.py (:14, 104: MoEPrepareAndFinalizeNaiveEP), or
        # v0.18.0's NVLink P/F modules beside the package (FM/flashinfer_nvlink_*_sided_
        # prepare_finalize.py, :14 and :10)
        for name in (f"{_FM}.prepare_finalize.naive_dp_ep",
                     f"{_FM}.prepare_finalize.flashinfer_nvlink_two_sided",
                     f"{_FM}.prepare_finalize.flashinfer_nvlink_one_sided",
                     f"{_FM}.flashinfer_nvlink_two_sided_prepare_finalize",
                     f"{_FM}.flashinfer_nvlink_one_sided_prepare_finalize",
                     f"{_FM}.flashinfer_cutlass_prepare_finalize",
                     f"{_FM}.prepare_finalize"):
            mod = oracle_comm.present_module(name)
            if mod is not None:
                p.set(mod, "nvfp4_block_scale_interleave", nvfp4.block_scale_interleave,
                      only_if_present=True)
        p.set("vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe",
              "swizzle_blockscale", cpu_swizzle_blockscale)
        if oracle_comm.two_sided_is_mnnvl():  # 0.14.0, 0.16.0, 0.20.0, 0.28.0
            two = oracle_comm.two_sided_module()
            p.set(two, "flashinfer_alltoall_dispatch", oracle_comm.mnnvl_alltoall_dispatch)
            p.set(two, "flashinfer_alltoall_combine", oracle_comm.mnnvl_alltoall_combine)
        p.set(f"{_FM}.all2all_utils", "flashinfer_one_sided_dispatch_layout",
              oracle_flashinfer.one_sided_dispatch_layout, only_if_present=True)  # not in 0.28.0
        # vLLM allocates on it (0.34.0's TRT-LLM experts' clamps, FM/experts/trtllm_nvfp4_moe.py:
        # 103; v0.18.0's DP-chunking buffers, FM/runner/default_moe_runner.py:299-310): the CPU
        p.set(torch.accelerator, "current_device_index", lambda: torch.device("cpu"))
        fused_moe_cls = getattr(importlib.import_module(f"{_FM}.layer"), "FusedMoE", None)
        runner = oracle_comm.present_module(f"{_FM}.runner.default_moe_runner")
        if hasattr(fused_moe_cls, "ensure_dp_chunking_init") or hasattr(  # none in 0.34.0
                getattr(runner, "DefaultMoERunner", None), "ensure_dp_chunking_init"):
            # v0.14.0 FM/layer.py:1527-1551 (v0.17.0 FM/runner/default_moe_runner.py:282-299)
            # allocates the DP-chunking staging buffers on ``torch.cuda.current_device()``;
            # there is no CUDA device here
            p.set(torch.cuda, "current_device", lambda: torch.device("cpu"))
        if backend in ("latency", "auto"):  # auto: vLLM picks among both stand-ins
            if not flashinfer_absent:
                raise NotImplementedError("the TRT-LLM seam stands in for FlashInfer only "
                                          "where it is not installed")
            # On v0.20.0 this replaces the enum stub above: its ``core`` holds the same
            # ``ActivationType`` twin, which both FlashInfer paths import. Before the experts
            # module is imported: v0.17.0's imports ``flashinfer`` at its top (FM/experts/
            # trtllm_nvfp4_moe.py:4) and calls ``flashinfer.fused_moe.trtllm_fp4_block_scale_
            # [routed_]moe`` through that name (:178, :297)
            trt_tree = oracle_trtllm.flashinfer_trtllm_stub()
            stub(trt_tree)
            trt = importlib.import_module(oracle_trtllm.TRT_EXPERTS)
            # ...and one imported earlier in this process (under the enum stub of a CUTLASS
            # row, or a seam since gone) holds an older tree under that name
            p.set(trt, "flashinfer", trt_tree["flashinfer"], only_if_present=True)
            p.set_cls(trt.TrtLlmNvFp4ExpertsBase, "_supports_current_device",
                      staticmethod(oracle_trtllm.trtllm_supports_current_device))
            # v0.28.0's modular TRT-LLM experts pack routing with a Triton kernel (FM/utils.py:
            # 391-459, FM/experts/trtllm_nvfp4_moe.py:24, 371); no Triton on CPU
            p.set(trt, "trtllm_moe_pack_topk_ids_weights",
                  oracle_trtllm.pack_topk_ids_weights, only_if_present=True)
        if backend == "vllm_cutlass":  # --moe-backend cutlass: vLLM's own CUTLASS kernel
            _vllm_cutlass(p, ops)
        if backend in B12X_EXPERTS:  # selection only: their kernels are not emulated
            module, cls = B12X_EXPERTS[backend]
            p.set_cls(getattr(importlib.import_module(module), cls), "_supports_current_device",
                      staticmethod(_family_120))
        # 0.28.0's workspace manager empties the device cache when it grows (v0.28.0
        # v1/worker/workspace.py:206); there is no device cache on CPU.
        p.set(torch.accelerator, "empty_cache", lambda: None, only_if_present=True)
        yield
    finally:
        p.undo()
        for name in stubbed:
            sys.modules.pop(name, None)


def simulates_vllm_cutlass() -> bool:
    """Does this vLLM have the NVFP4 ``CutlassExpertsFp4`` with its own device probe and the
    experts-quant ops the ``backend="vllm_cutlass"`` seam replaces (read on v0.34.0:
    FM/experts/cutlass_moe.py:511-838, _custom_ops.py:1548-1667)?"""
    import vllm._custom_ops as ops

    mod = oracle_comm.present_module(oracle_vllm_cutlass._CUTLASS_MOE)
    experts = getattr(mod, "CutlassExpertsFp4", None)
    return (experts is not None and "_supports_current_device" in vars(experts)
            and all(hasattr(ops, name) for name in oracle_vllm_cutlass.OPS))


def _vllm_cutlass(p: _ClassPatcher, ops) -> None:
    """vLLM's own CUTLASS NVFP4 MoE (``CutlassExpertsFp4``, v0.34.0 FM/experts/cutlass_moe.py):
    its device probe without ``is_cuda()``, the CUDA ops ``run_cutlass_moe_fp4`` calls
    (:511-704) and the Triton route remap it calls under EP (:502-508), by
    :mod:`.oracle_vllm_cutlass`; the workspaces it is handed, poisoned (module docstring)."""
    if not simulates_vllm_cutlass():
        raise NotImplementedError("this vLLM has no CutlassExpertsFp4 with the NVFP4 experts "
                                  "ops the seam simulates (read on 0.34.0)")
    mod = importlib.import_module(oracle_vllm_cutlass._CUTLASS_MOE)
    p.set_cls(mod.CutlassExpertsFp4, "_supports_current_device",
              staticmethod(oracle_vllm_cutlass.vllm_cutlass_supports_current_device))
    p.set(mod, "remap_topk_to_local", oracle_vllm_cutlass.remap_topk_to_local,
          only_if_present=True)
    for name, fn in oracle_vllm_cutlass.OPS.items():
        p.set(ops, name, fn)
    workspace = oracle_comm.present_module("vllm.v1.worker.workspace")
    manager = getattr(workspace, "WorkspaceManager", None)
    if manager is not None:
        p.set_cls(manager, "get_simultaneous",
                  oracle_vllm_cutlass.poisoned(manager.get_simultaneous))


def takes_moe_backend() -> bool:
    """Does this vLLM take ``--moe-backend`` (``KernelConfig.moe_backend``)? Earlier oracle
    releases pick FlashInfer's NVFP4 MoE backend by environment variables (v0.14.0
    FM/oracle/nvfp4.py:80-101)."""
    import vllm.config

    kernel_config = getattr(vllm.config, "KernelConfig", None)
    return "moe_backend" in getattr(kernel_config, "__dataclass_fields__", {})


def _family_120() -> bool:
    """The B12X experts' device probes (v0.34.0 FM/b12x.py:499-509,
    FM/experts/flashinfer_b12x_moe.py:182-188) without ``is_cuda()`` and the kernel package:
    the 12.x family, as on the reported GPU."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_device_capability_family(120))


#: seam backend -> (module, experts class) of the B12X backends (v0.34.0 FM/oracle/nvfp4.py:
#: 89-92, 127-132): vLLM's own (``--moe-backend b12x``) and FlashInfer's (``flashinfer_b12x``).
#: The seam answers their device probe only, for vLLM's backend selection: a layer built on
#: them cannot run (their kernels are not emulated).
B12X_EXPERTS = {"b12x": (f"{_FM}.b12x", "B12xExperts"),
                "flashinfer_b12x": (f"{_FM}.experts.flashinfer_b12x_moe", "FlashInferB12xExperts")}

MOE_BACKEND = "flashinfer_cutlass"  # KernelConfig.moe_backend the layouts ask for
#: seam backend -> the ``--moe-backend`` (KernelConfig.moe_backend) a user picks it with
MOE_BACKENDS = {"throughput": MOE_BACKEND, "latency": "flashinfer_trtllm", "auto": "auto",
                "vllm_cutlass": "cutlass", "b12x": "b12x", "flashinfer_b12x": "flashinfer_b12x"}
