# SPDX-License-Identifier: Apache-2.0
"""``fp4_quantize`` with FlashInfer 0.3.1's exact Python contract, on any device.

Why: vLLM 0.11.0's prepare step calls ``flashinfer.fp4_quantize(a1, a1_gscale)`` with a
per-expert vector (``flashinfer_cutlass_prepare_finalize.py:171-178``); the kernel reads only
``SFScale[0]`` (``quantization.cuh:763``). Emulating that faithfully is what lets CPU tests
reproduce -- and the plugin's tests rule out -- the activation-scale bug.

Contract mirrored (``flashinfer/fp4_quantization.py:313-375``, C++ ``thop/fp4Quantize.cpp:40-143``):

* input ``[..., K]`` fp16/bf16, K % 16 == 0; a column-major 2-D input (``stride(-2) == 1``) is
  transposed, quantized and both outputs transposed back, exactly as the wrapper does;
* returns ``(x_q uint8 [..., K/2], sf uint8)``; the SF buffer holds ``pad(M,128)*pad(K/16,4)``
  bytes (swizzled) or ``M*K/16`` (linear) and is reshaped by the wrapper to ``(-1, K/16)`` --
  so for swizzled output it is ``[Mp, K/16]`` only when K/16 % 4 == 0 (and a reshape error
  otherwise, as in the real wrapper);
* ``global_scale`` must be a float32 tensor; ONLY ELEMENT 0 IS READ, whatever its shape.
"""

from __future__ import annotations

from typing import Optional

import torch

from .constants import BLOCK_SIZE
from .layout import swizzle_128x4
from .quantize import quantize


def fp4_quantize(
    input: torch.Tensor,
    global_scale: Optional[torch.Tensor] = None,
    sf_vec_size: int = 16,
    sf_use_ue8m0: bool = False,
    is_sf_swizzled_layout: bool = True,
    is_sf_8x4_layout: bool = False,
    enable_pdl: Optional[bool] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Emulates ``flashinfer.fp4_quantize`` (NVFP4, 128x4 or linear SF). ``enable_pdl`` is a
    launch detail and is ignored."""
    if sf_vec_size != 16 and sf_vec_size != 32:
        raise NotImplementedError("sf_vec_size can only be 16 or 32")
    if sf_use_ue8m0 or sf_vec_size != BLOCK_SIZE:
        raise NotImplementedError(
            "emulated fp4_quantize covers NVFP4 only (sf_vec_size=16, E4M3 scales); "
            "MXFP4 (sf_use_ue8m0=True, sf_vec_size=32) is not emulated"
        )
    if is_sf_swizzled_layout and is_sf_8x4_layout:
        raise NotImplementedError("the SWIZZLED_8x4 scale layout is not emulated")

    is_column_major = input.stride(-2) == 1
    if is_column_major:
        input = input.transpose(-2, -1)
    assert input.shape[-1] % sf_vec_size == 0

    if global_scale is None:
        raise RuntimeError("globalScale is required when sfUseUE8M0 is false")
    if global_scale.dtype != torch.float32:
        raise RuntimeError(f"expected scalar type Float but found {global_scale.dtype}")
    if input.dim() < 2:
        raise RuntimeError("Input should be >=2D tensor.")
    if input.dtype not in (torch.float16, torch.bfloat16):
        raise NotImplementedError(
            f"emulated fp4_quantize supports fp16/bf16 input, got {input.dtype} "
            "(the real one also takes float8_e4m3fn, not emulated)"
        )

    k = input.shape[-1]
    flat = input.reshape(-1, k)
    # The kernel reads SFScale[0] only (quantization.cuh:763): reproduce that, never "fix" it.
    g0 = global_scale.reshape(-1)[0]
    packed, sf = quantize(flat, g0, convention="flashinfer")
    x_q = packed.reshape(*input.shape[:-1], k // 2)
    sf_bytes = sf.view(torch.uint8)
    if is_sf_swizzled_layout:
        sf_bytes = swizzle_128x4(sf_bytes)
    sf_out = sf_bytes.reshape(-1).reshape((-1, k // sf_vec_size))

    if is_column_major:
        x_q = x_q.transpose(-2, -1)
        sf_out = sf_out.transpose(-2, -1)
    return x_q, sf_out
