# SPDX-License-Identifier: Apache-2.0
"""FlashInfer's CUTLASS NVFP4 MoE contract as vLLM's oracle design (0.14.0+) calls it, on CPU:
the kernel (the emulator, or the ideal-NVFP4 reference loop), vLLM's ``scaled_fp4_quant`` op,
the enums vLLM imports from FlashInfer, and the device probe without ``is_cuda()``. Part of the
seam :mod:`.blackwell_oracle` installs (its docstring lists every symbol replaced and why)."""

from __future__ import annotations

import enum
from typing import Optional

import torch

from fp4_moe_lab import nvfp4


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


# vLLM's MoEActivation name -> FlashInfer's type, for the activations the emulator covers
# (v0.34.0 Q/utils/flashinfer_utils.py:39-70: SILU -> Swiglu, RELU2_NO_MUL -> Relu2)
_EMULATED = {"SILU": ActivationType.Swiglu, "RELU2_NO_MUL": ActivationType.Relu2}
_KERNEL_ACTIVATION = {ActivationType.Swiglu: "swiglu", ActivationType.Relu2: "relu2"}


def activation_to_flashinfer_type(activation) -> ActivationType:
    """v0.34.0 Q/utils/flashinfer_utils.py:39-70 for the activations the emulator covers."""
    kind = _EMULATED.get(getattr(activation, "name", None))
    if kind is None:
        raise NotImplementedError(f"emulator covers SiLU (SwiGLU) and non-gated relu2 only, "
                                  f"not {activation!r}")
    return kind


def fi_cutlass_fused_moe(*, activation_type=ActivationType.Swiglu,
                          swizzled_input_sf: bool = True, use_packed_weights: bool = False,
                          use_wfp4afp8_humming: bool = False, **kwargs):
    """FlashInfer 0.7.3 ``cutlass_fused_moe`` (fi 0.6.18 flashinfer/fused_moe/core.py:1180-1217)
    for NVFP4 with SwiGLU or non-gated Relu2, on the emulator (or the reference loop). Anything
    the emulator does not model is refused."""
    if activation_type not in _KERNEL_ACTIVATION:
        raise NotImplementedError(f"emulator covers SwiGLU and Relu2 only, not "
                                  f"{activation_type!r}")
    if not swizzled_input_sf or use_packed_weights or use_wfp4afp8_humming:
        raise NotImplementedError("linear input SF, packed weights and the Humming path are "
                                  "not emulated")
    kwargs.pop("use_fused_finalize", None)  # a kernel-fusion choice; the result is the same
    return _KERNEL["cutlass"](activation=_KERNEL_ACTIVATION[ActivationType(activation_type)],
                              **kwargs)


# What ``fi_cutlass_fused_moe`` runs: the emulator, or (``simulated_blackwell(kernel=
# "reference")``) the ideal-NVFP4 loop of :mod:`.reference_kernel`.
_KERNEL = {"cutlass": nvfp4.cutlass_fused_moe}


class QuantFormat(enum.Enum):
    """Stand-in for ``flashinfer.fused_moe.QuantFormat`` (FlashInfer 0.7.x; not in the 0.6.18
    source read). vLLM only passes it through to the one-sided communication as the payload
    format; the gloo twin moves bytes whatever their format."""

    NVFP4 = "nvfp4"


def one_sided_dispatch_layout(hidden_dim: int, quant_config, input_dtype=None):
    """v0.34.0 FM/all2all_utils.py:56-104 for NVFP4 dispatch, the case simulated; the import
    of FlashInfer's enum (:68) is what cannot run here."""
    from vllm.model_executor.layers.fused_moe.all2all_utils import FlashInferOneSidedDispatchLayout

    if input_dtype is not None or quant_config.quant_dtype != "nvfp4":
        raise NotImplementedError("the one-sided twin covers NVFP4 dispatch only")
    return FlashInferOneSidedDispatchLayout(QuantFormat.NVFP4)


def cpu_scaled_fp4_quant(input: torch.Tensor, input_global_scale: torch.Tensor,
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


def flashinfer_module_tree() -> dict:
    """Empty stand-ins for ``flashinfer``, ``flashinfer.fused_moe`` and its ``core``, linked as
    submodules, for the seam to fill and put in ``sys.modules`` while FlashInfer is not
    installed."""
    import importlib.machinery
    import types

    mods = {}
    for name in ("flashinfer", "flashinfer.fused_moe", "flashinfer.fused_moe.core"):
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        mods[name] = m
    mods["flashinfer"].fused_moe = mods["flashinfer.fused_moe"]
    mods["flashinfer.fused_moe"].core = mods["flashinfer.fused_moe.core"]
    return mods


def flashinfer_enum_stub() -> dict:
    """v0.20.0 ``FlashInferExperts.apply`` imports ``flashinfer.fused_moe.core.ActivationType``
    itself (FM/flashinfer_cutlass_moe.py:262). Without FlashInfer installed, the seam provides
    that one module with only the :class:`ActivationType` twin, for the seam's duration."""
    mods = flashinfer_module_tree()
    mods["flashinfer.fused_moe.core"].ActivationType = ActivationType
    return mods


def fi_cutlass_supports_current_device() -> bool:
    """v0.34.0 FM/experts/flashinfer_cutlass_moe.py:134-146 without ``is_cuda()`` (and with the
    kernel present, the emulator): exactly 9.0, or the 10.x or 12.x family; 11.x is excluded
    there (flashinfer-ai/flashinfer#3134). NVFP4 itself is ``_supports_quant_scheme``'s
    question (:184-189), left to vLLM."""
    from vllm.platforms import current_platform as p

    return (p.is_device_capability(90) or p.is_device_capability_family(100)
            or p.is_device_capability_family(120))
