# SPDX-License-Identifier: Apache-2.0
"""E2M1 (FP4) codes: rounding, decoding and nibble packing.

Why our own: the kernels use ``cvt.rn.satfinite.e2m1x2.f32`` (FlashInfer 0.3.1
``csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh:274-277``), the Python references use
interval tables (vLLM 0.11.0 ``nvfp4_emulation_utils.py:79-90``, compressed-tensors 0.11.0
``quant_args.py`` ``cast_to_fp4``). All are round-to-nearest-even with saturation at +-6; the
tables below implement exactly that, in tensor ops only (any device).
"""

from __future__ import annotations

import torch

from .constants import E2M1_VALUES

# Midpoints between neighbouring E2M1 magnitudes (0, .5, 1, 1.5, 2, 3, 4, 6). At a midpoint RNE
# picks the neighbour with an even mantissa: ties at 0.25, 1.25, 2.5, 5.0 round DOWN (to 0, 1, 2,
# 4) and ties at 0.75, 1.75, 3.5 round UP (to 1, 2, 4). So ">" for the first group, ">=" else.
_TIE_DOWN = (0.25, 1.25, 2.5, 5.0)
_TIE_UP = (0.75, 1.75, 3.5)


def e2m1_round(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values to E2M1 codes (uint8 in [0, 16)), RNE, saturating at +-6.

    The sign bit (8) always follows the sign of the input, so ``-0.1 -> 8`` (-0.0). That is what
    IEEE rounding in ``cvt.rn.satfinite`` gives (inferred from the PTX semantics, not observed on
    hardware) and what compressed-tensors 0.11.0 stores (``cast_to_fp4`` returns ``|x|*sign(x)``
    = -0.0 and ``pack_fp4_to_uint8`` uses ``torch.signbit``, ``nvfp4_quantized.py:129-171``).
    +-inf saturate to +-6; NaN becomes +-0 (E2M1 has no NaN; the kernel's NaN result is not
    documented, and only ``0 * inf`` in a block whose scale underflowed can produce one).
    """
    a = x.float().abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t in _TIE_DOWN:
        mag += (a > t).to(torch.uint8)
    for t in _TIE_UP:
        mag += (a >= t).to(torch.uint8)
    neg = torch.signbit(x.float()).to(torch.uint8)
    return mag | (neg << 3)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Codes (any integer dtype) -> fp32 values via the 16-entry table."""
    return E2M1_VALUES.to(codes.device)[codes.long()]


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """``[..., K]`` codes -> ``[..., K/2]`` uint8; element 2i in the LOW nibble (all tools agree,
    docs/NVFP4-FORMAT.md §1.3)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dim, got {tuple(codes.shape)}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """``[..., K/2]`` uint8 -> ``[..., K]`` uint8 codes (inverse of :func:`pack_fp4`)."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    out = torch.stack((p & 0x0F, p >> 4), dim=-1)
    return out.reshape(*p.shape[:-1], p.shape[-1] * 2)
