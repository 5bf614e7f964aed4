# SPDX-License-Identifier: Apache-2.0
"""Block-scale layouts: checkpoints store ``[M, K/16]`` row-major, the kernels read 128x4 tiles.

Why our own: vLLM 0.11.0's ``swizzle_blockscale`` ends in ``.cuda()``
(``vllm/model_executor/layers/quantization/utils/quant_utils.py:591-634``) and FlashInfer's
``block_scale_interleave`` needs a GPU to pick its JIT module (``flashinfer/fp4_quantization.py:
378-404``), so neither runs in CPU tests. These functions are pure tensor ops on any device.

Layout (FlashInfer 0.3.1 ``csrc/nv_internal/tensorrt_llm/kernels/quantization.cuh:624-664``,
``get_sf_out_offset_128x4``): rows padded to 128, scale columns padded to 4, then tiles of
128 rows x 4 columns (512 bytes), K-tile-major inside an M-tile; inside a tile row ``m`` sits at
``(m % 32) * 16 + (m % 128 // 32) * 4``. Padding bytes are 0 (``quantization.cuh:810-815``).
"""

from __future__ import annotations

import torch

_ROWS = 128  # rows per tile
_COLS = 4  # scale columns per tile


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret 1-byte tensors (uint8/int8/float8) as uint8, keeping the shape."""
    if t.element_size() != 1:
        raise TypeError(f"expected a 1-byte dtype (uint8/float8), got {t.dtype}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _tile_permute(t: torch.Tensor, b: int, mp: int, kp: int, *, forward: bool) -> torch.Tensor:
    # Forward: [B, Mt, 4(innerM), 32(outerM), Kt, 4(innerK)] -> [B, Mt, Kt, 32, 4, 4].
    # The permutation (0, 1, 4, 3, 2, 5) is its own inverse; only the viewed shape differs.
    if forward:
        view = t.reshape(b, mp // _ROWS, 4, 32, kp // _COLS, _COLS)
    else:
        view = t.reshape(b, mp // _ROWS, kp // _COLS, 32, 4, _COLS)
    return view.permute(0, 1, 4, 3, 2, 5).reshape(b, mp, kp)


def swizzle_128x4(sf: torch.Tensor) -> torch.Tensor:
    """Linear ``[M, Ks]`` or ``[B, M, Ks]`` -> zero-padded swizzled ``[..., Mp, Kp]``, same dtype.

    Same result as vLLM's ``swizzle_blockscale`` (quant_utils.py:591-634) minus the ``.cuda()``.
    Works for any 1-byte dtype (float8_e4m3fn, uint8).
    """
    if sf.dim() not in (2, 3):
        raise ValueError(f"swizzle_128x4 expects a 2-D or 3-D tensor, got {tuple(sf.shape)}")
    raw = _as_bytes(sf)
    squeeze = raw.dim() == 2
    if squeeze:
        raw = raw.unsqueeze(0)
    b, m, ks = raw.shape
    mp, kp = _round_up(m, _ROWS), _round_up(ks, _COLS)
    padded = torch.zeros((b, mp, kp), dtype=torch.uint8, device=raw.device)
    padded[:, :m, :ks] = raw
    out = _tile_permute(padded, b, mp, kp, forward=True).contiguous()
    if squeeze:
        out = out[0]
    return out.view(sf.dtype) if sf.dtype != torch.uint8 else out


def unswizzle_128x4(swz: torch.Tensor, m: int, ks: int) -> torch.Tensor:
    """Inverse of :func:`swizzle_128x4`: ``[..., Mp, Kp]`` (or a flat buffer) -> ``[..., m, ks]``.

    Accepts what the kernels and wrappers hand around: a 2-D/3-D swizzled tensor, a 1-D flat
    buffer of ``B * Mp * Kp`` bytes (``block_scale_interleave`` output), or the same bytes in
    another shape (``fp4_quantize`` reshapes its SF to ``(-1, K/16)``). Any 1-byte dtype.
    """
    mp, kp = _round_up(m, _ROWS), _round_up(ks, _COLS)
    raw = _as_bytes(swz)
    tile = mp * kp
    if raw.dim() >= 2 and tuple(raw.shape[-2:]) == (mp, kp):
        lead = tuple(raw.shape[:-2])
    elif raw.numel() % tile == 0:
        lead = () if raw.numel() == tile else (raw.numel() // tile,)
    else:
        raise ValueError(
            f"{tuple(swz.shape)} is not a 128x4-swizzled buffer for m={m}, ks={ks} "
            f"(expected a multiple of {mp}x{kp} bytes)"
        )
    b = 1
    for d in lead:
        b *= d
    lin = _tile_permute(raw.reshape(b, mp, kp), b, mp, kp, forward=False)
    out = lin[:, :m, :ks].reshape(*lead, m, ks).contiguous()
    return out.view(swz.dtype) if swz.dtype != torch.uint8 else out


def sf_offset_128x4(m: int, k: int, ks: int, *, m_total: int | None = None, batch: int = 0) -> int:
    """Byte offset of block scale (row ``m``, scale column ``k``) in a 128x4 buffer with ``ks``
    scale columns. Mirrors ``get_sf_out_offset_128x4`` (quantization.cuh:624-664); ``batch`` and
    ``m_total`` (rows per batch entry) give the batched stride ``ceil(m_total/128)*Kt*512``."""
    k_tiles = (ks + _COLS - 1) // _COLS
    m_tile_stride = k_tiles * 512
    off = (m // _ROWS) * m_tile_stride + (k // _COLS) * 512 + (m % 32) * 16 + (m % _ROWS // 32) * 4
    off += k % _COLS
    if batch:
        if m_total is None:
            raise ValueError("batch offsets need m_total")
        off += batch * ((m_total + _ROWS - 1) // _ROWS) * m_tile_stride
    return off


def block_scale_interleave(unswizzled_sf: torch.Tensor) -> torch.Tensor:
    """Mirror of FlashInfer 0.3.1 ``block_scale_interleave`` (= ``nvfp4_block_scale_interleave``).

    Contract (``flashinfer/fp4_quantization.py:378-404``; C++ ``BlockScaleInterleave``,
    ``csrc/nv_internal/tensorrt_llm/thop/fp4Op.cpp:143-195``): uint8 input (asserted), 2-D
    ``[rows, cols]`` or 3-D ``[E, rows, cols]``; returns a **1-D** uint8 tensor of
    ``E * pad(rows, 128) * pad(cols, 4)`` bytes, zero padded.
    """
    assert unswizzled_sf.dtype == torch.uint8, (
        f"Input dtype must be uint8, got {unswizzled_sf.dtype}"
    )
    if unswizzled_sf.dim() not in (2, 3):
        raise RuntimeError("Block Scale should be 2D or 3D tensor.")
    return swizzle_128x4(unswizzled_sf).reshape(-1)
