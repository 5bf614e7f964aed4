# SPDX-License-Identifier: Apache-2.0
"""NVFP4 quantize / dequantize with a linear block-scale layout (docs/NVFP4-FORMAT.md §3.2).

Why two conventions: the tools compute the same recipe with different IEEE operation orders, and
the order decides a code at a rounding boundary (~0.06 % of codes, docs/NVFP4-FORMAT.md §3.6). A
test that wants bit equality must pick the order of the thing it is compared with:

* ``"flashinfer"`` -- the kernel (FlashInfer 0.3.1 ``quantization.cuh:438-448``,
  ``cvt_warp_fp16_to_fp4``)::

      SF  = e4m3(gs * (vecMax * rcp(6)))
      out = vecMax != 0 ? rcp(float(SF) * rcp(gs)) : 0
      q   = e2m1(x * out)

  We use exact IEEE reciprocals where the kernel uses ``rcp.approx.ftz``; the two can differ by
  one ulp, which can flip a code that sits exactly on a boundary (not observable without SM100).
  vLLM 0.11.0's ``ref_nvfp4_quant`` (``nvfp4_emulation_utils.py:93-108``) uses this same order.
* ``"compressed_tensors"`` -- compressed-tensors 0.11.0, i.e. llm-compressor checkpoints::

      SF = e4m3(clamp(gs * (amax / 6), -448, 448))          # helpers.py:104-108
      q  = e2m1(clamp(x / (float(SF) / gs), -6, 6))          # lifecycle/forward.py:454-486

Zero blocks: we store SF = 0 and codes 0 in both conventions (what the kernels write).
compressed-tensors stores SF = 0.125 instead (``helpers.py:113-121``) and ModelOpt 1.0
(``nvfp4_tensor.py:85-86``); the codes are 0 and the dequantized values 0 either way, so a writer
that must match those files byte-for-byte replaces ``sf == 0`` afterwards.
"""

from __future__ import annotations

import torch

from .constants import BLOCK_SIZE, E4M3_MAX, FP4_MAX
from .e2m1 import e2m1_decode, e2m1_round, pack_fp4, unpack_fp4

CONVENTIONS = ("flashinfer", "compressed_tensors")


def global_scale(amax) -> torch.Tensor:
    """Per-tensor global scale ``g = 448 * 6 / amax`` in fp32 (= 1 / ModelOpt ``weight_scale_2``
    or ``input_scale``).

    Written as torch's ``float / tensor``, which evaluates ``reciprocal(amax) * 2688`` (two
    roundings), exactly like CT's ``generate_gparam`` (``helpers.py:460-480``) and vLLM's test
    helper ``get_nvfp4_global_scale`` -- so our scales are bit-identical to theirs.
    """
    a = torch.as_tensor(amax, dtype=torch.float32)
    return (E4M3_MAX * FP4_MAX) / a


def e4m3_rne_sat(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> float8_e4m3fn, round-to-nearest-even, saturating at +-448 (clamp first: the
    kernel's ``__nv_fp8_e4m3(float)`` saturates, torch's cast is not guaranteed to)."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _broadcast_gs(gs, x: torch.Tensor) -> torch.Tensor:
    """gs -> fp32 tensor on x's device that broadcasts against the block-amax shape [*lead, Kb]."""
    g = torch.as_tensor(gs, dtype=torch.float32).to(device=x.device, dtype=torch.float32)
    lead = tuple(x.shape[:-1])
    if g.numel() == 1:
        return g.reshape(())
    try:
        ok = torch.broadcast_shapes(tuple(g.shape), lead) == lead
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(
            f"global scale of shape {tuple(g.shape)} does not broadcast to the leading dims "
            f"{lead} of x (use e.g. [E, 1] for x [E, N, K], or [M] for x [M, K])"
        )
    return g.unsqueeze(-1)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    k = x.shape[-1]
    if k % BLOCK_SIZE:
        raise ValueError(f"last dim {k} is not a multiple of {BLOCK_SIZE}")
    return x.float().reshape(*x.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)


def quantize_codes(x: torch.Tensor, gs, *, convention: str = "flashinfer"):
    """Like :func:`quantize` but returns unpacked codes ``[..., K]`` (uint8) and the linear SF."""
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, got {convention!r}")
    xb = _blocks(x)
    g = _broadcast_gs(gs, x)
    vmax = xb.abs().amax(dim=-1)
    if convention == "flashinfer":
        rcp6 = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32, device=x.device)
        sf = e4m3_rne_sat(g * (vmax * rcp6))
        inv_g = torch.reciprocal(g)
        out_scale = torch.where(
            vmax != 0, torch.reciprocal(sf.float() * inv_g), torch.zeros_like(vmax)
        )
        q = xb * out_scale.unsqueeze(-1)
    else:
        sf = e4m3_rne_sat(g * (vmax / FP4_MAX))
        scale = (sf.float() / g).unsqueeze(-1)
        safe = torch.where(scale != 0, scale, torch.ones_like(scale))
        q = torch.where(scale != 0, xb / safe, torch.zeros_like(xb)).clamp(-FP4_MAX, FP4_MAX)
    codes = e2m1_round(q).reshape(x.shape)
    return codes, sf


def quantize(x: torch.Tensor, gs, *, convention: str = "flashinfer"):
    """Quantize along the last dim in blocks of 16.

    ``gs``: float, 0-dim/1-element tensor, or a tensor broadcastable to ``x.shape[:-1]``.
    Returns ``(packed uint8 [..., K/2], sf float8_e4m3fn [..., K/16])`` (linear layout).
    """
    codes, sf = quantize_codes(x, gs, convention=convention)
    return pack_fp4(codes), sf


def dequantize(packed: torch.Tensor, sf: torch.Tensor, gs, dtype: torch.dtype = torch.float32):
    """``e2m1 * (float(sf) / gs)`` in fp32, then cast -- the order of both CT's ``_dequantize``
    (``forward.py:490-517``) and vLLM's ``dequantize_to_dtype`` (``nvfp4_emulation_utils.py:63-66``)
    so the results are bit-identical to theirs."""
    vals = e2m1_decode(unpack_fp4(packed))
    vb = _blocks(vals)
    g = _broadcast_gs(gs, vals)
    scale = sf.float() / g
    return (vb * scale.unsqueeze(-1)).reshape(vals.shape).to(dtype)
