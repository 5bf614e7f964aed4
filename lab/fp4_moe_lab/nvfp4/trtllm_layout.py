# SPDX-License-Identifier: Apache-2.0
"""The TRT-LLM ("trtllm-gen") NVFP4 MoE weight layout: shuffles, their inverses, and a builder of
what vLLM 0.11.0 hands ``trtllm_fp4_block_scale_moe``.

Why our own: FlashInfer's ``shuffle_matrix_sf_a`` ends in ``block_scale_interleave``, which needs
a GPU to pick its JIT module (FlashInfer 0.3.1 ``flashinfer/fp4_quantization.py:398-403``), and the
emulator must undo the layout anyway. Pure tensor ops, any device. Citations: FlashInfer 0.3.1
(``fi.utils`` = ``flashinfer/utils.py``, ``fi.fp4`` = ``flashinfer/fp4_quantization.py``,
``fi.core`` = ``flashinfer/fused_moe/core.py``) and vLLM 0.11.0 (``modelopt.py`` =
``vllm/model_executor/layers/quantization/modelopt.py``).

What vLLM 0.11.0 does to each expert (``modelopt.py:1196-1283``, called at ``:1330-1343`` after
``reorder_w1w3_to_w3w1`` put the checkpoint's ``[w1; w3]`` rows in ``[w3; w1]`` order,
``:1290-1292``):

1. GEMM1 rows (weights and linear block scales alike): ``reorder_rows_for_gated_act_gemm``
   interleaves the two halves, ``[r0, rN/2, r1, rN/2+1, ...]`` (fi.core:219-255), so each up (w3)
   row sits right before its gate (w1) row.
2. Every matrix (GEMM1 after step 1, GEMM2 as loaded): ``shuffle_matrix_a`` permutes rows inside
   blocks of 32 (``epilogue_tile_m = 128``, a constant in vLLM, ``modelopt.py:1209``; 16 for a
   tile that is not a multiple of 128) with ``srcToDstBlk32RowMap`` (fi.utils:638-707,
   fi.fp4:449-455). ``shuffle_matrix_sf_a`` applies the same row permutation to the LINEAR block
   scales, then the 128x4 swizzle of ``block_scale_interleave`` (fi.utils:710-727, fi.fp4:458-479).
3. The per-expert 1-D swizzled bytes are stacked and reshaped to ``[E, rows, cols]``
   (``modelopt.py:1270-1281``), which only fits when rows % 128 == 0 and cols % 4 == 0.
"""

from __future__ import annotations

from typing import Optional

import torch

from .layout import swizzle_128x4, unswizzle_128x4

#: vLLM 0.11.0 and FlashInfer's own tests use 128 (``modelopt.py:1209`` "FIXME: this depends on
#: the kernel internals"); the kernel reads what this tile size produces.
EPILOGUE_TILE_M = 128

# fi.utils:638-659: destination row, inside a block, of each source row.
_BLK16 = [0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]
_BLK32 = [0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27,
          4, 12, 20, 28, 5, 13, 21, 29, 6, 14, 22, 30, 7, 15, 23, 31]


def shuffle_block_size(epilogue_tile_m: int) -> int:
    """32 when the epilogue tile is a multiple of 128, else 16 (fi.utils:663-667)."""
    return 32 if epilogue_tile_m % 128 == 0 else 16


def shuffle_row_sources(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """``src[new_row] = old_row`` of ``shuffle_matrix_a`` for a matrix of ``rows`` rows."""
    size = shuffle_block_size(epilogue_tile_m)
    if rows % size:
        raise ValueError(f"shuffle_matrix_a needs rows % {size} == 0, got {rows}")
    dst_in_block = torch.tensor(_BLK32 if size == 32 else _BLK16, dtype=torch.long)
    old = torch.arange(rows, dtype=torch.long)
    new = old // size * size + dst_in_block[old % size]
    src = torch.empty(rows, dtype=torch.long)
    src[new] = old
    return src


def gated_row_sources(rows: int) -> torch.Tensor:
    """``src[new_row] = old_row`` of ``reorder_rows_for_gated_act_gemm`` (fi.core:219-244)."""
    if rows % 2:
        raise ValueError(f"the gated-activation reorder needs an even row count, got {rows}")
    src = torch.empty(rows, dtype=torch.long)
    src[0::2] = torch.arange(rows // 2)
    src[1::2] = torch.arange(rows // 2, rows)
    return src


def gemm1_row_sources(rows: int, epilogue_tile_m: int = EPILOGUE_TILE_M) -> torch.Tensor:
    """Both GEMM1 steps chained: row ``i`` of the kernel's matrix is row ``src[i]`` of ``[w3; w1]``
    (the composition ``permute0[permute1]`` of fi.core:169-193)."""
    return gated_row_sources(rows)[shuffle_row_sources(rows, epilogue_tile_m)]


def _inverse(src: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(src)
    inv[src] = torch.arange(src.numel(), dtype=src.dtype)
    return inv


def _rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return x.index_select(-2, index.to(x.device))


def _swizzled_sf(linear_rows_permuted: torch.Tensor) -> torch.Tensor:
    """[E, rows, cols] 1-byte -> the kernel's [E, rows, cols] float8 view of 128x4 bytes."""
    e, rows, cols = linear_rows_permuted.shape
    if rows % 128 or cols % 4:
        raise ValueError(
            f"block scales [{rows}, {cols}] do not fill whole 128x4 tiles: vLLM 0.11.0's reshape "
            "of the interleaved scales (modelopt.py:1270-1281) needs rows % 128 == 0 and "
            "cols % 4 == 0")
    raw = swizzle_128x4(linear_rows_permuted.view(torch.uint8)).reshape(e, rows, cols)
    return raw.view(torch.float8_e4m3fn)


def shuffle_gemm1(w13: torch.Tensor, w13_sf: torch.Tensor,
                  epilogue_tile_m: int = EPILOGUE_TILE_M):
    """``[E, 2I, H/2]`` packed weights and ``[E, 2I, H/16]`` linear scales, rows in ``[w3; w1]``
    order -> (weights uint8, scales float8 in 128x4 bytes) as vLLM 0.11.0 stores them."""
    src = gemm1_row_sources(w13.shape[-2], epilogue_tile_m)
    return _rows(w13.view(torch.uint8), src).contiguous(), _swizzled_sf(_rows(w13_sf, src))


def shuffle_gemm2(w2: torch.Tensor, w2_sf: torch.Tensor,
                  epilogue_tile_m: int = EPILOGUE_TILE_M):
    """``[E, H, I/2]`` weights and ``[E, H, I/16]`` linear scales -> the kernel's layout."""
    src = shuffle_row_sources(w2.shape[-2], epilogue_tile_m)
    return _rows(w2.view(torch.uint8), src).contiguous(), _swizzled_sf(_rows(w2_sf, src))


def _linear_sf(sf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if rows % 128 or cols % 4:
        raise ValueError(f"a [{rows}, {cols}] block-scale matrix is not whole 128x4 tiles; the "
                         "kernel's scale layout (R128c4) needs rows % 128 == 0, cols % 4 == 0")
    return unswizzle_128x4(sf.view(torch.uint8), rows, cols)


def unshuffle_gemm1(gemm1_weights: torch.Tensor, gemm1_weights_scale: torch.Tensor,
                    epilogue_tile_m: int = EPILOGUE_TILE_M):
    """Inverse of :func:`shuffle_gemm1`: the kernel's tensors -> ``[w3; w1]`` rows, packed
    weights (uint8) and LINEAR scales (uint8 bytes of float8_e4m3fn)."""
    e, rows, _ = gemm1_weights.shape
    inv = _inverse(gemm1_row_sources(rows, epilogue_tile_m))
    sf = _linear_sf(gemm1_weights_scale, rows, gemm1_weights_scale.shape[-1])
    return _rows(gemm1_weights.view(torch.uint8), inv), _rows(sf, inv)


def unshuffle_gemm2(gemm2_weights: torch.Tensor, gemm2_weights_scale: torch.Tensor,
                    epilogue_tile_m: int = EPILOGUE_TILE_M):
    """Inverse of :func:`shuffle_gemm2`."""
    rows = gemm2_weights.shape[-2]
    inv = _inverse(shuffle_row_sources(rows, epilogue_tile_m))
    sf = _linear_sf(gemm2_weights_scale, rows, gemm2_weights_scale.shape[-1])
    return _rows(gemm2_weights.view(torch.uint8), inv), _rows(sf, inv)


def to_trtllm_inputs(experts, *, a1_gs, a2_gs: Optional[torch.Tensor] = None,
                     epilogue_tile_m: int = EPILOGUE_TILE_M) -> dict:
    """kwargs of ``trtllm_fp4_block_scale_moe`` that hold the layer: the four shuffled weight
    tensors and the three per-expert output scales, exactly as vLLM 0.11.0 builds them from a
    :class:`~.reference.QuantizedExperts` whose activations are quantized with ``a1_gs``
    (ModelOpt, ``modelopt.py:1285-1366``):

    * ``output1_scale_gate_scalar = g1_alphas = input_scale * weight_scale_2`` (the GEMM1
      dequant factor, ``:1308-1314``);
    * ``output1_scale_scalar = g1_scale_c = w2_input_scale_quant * g1_alphas`` (dequant of
      GEMM1 times the GEMM2-input quant scale, ``:1355-1360``);
    * ``output2_scale_scalar = g2_alphas = w2_input_scale * w2_weight_scale_2`` (``:1320-1323``).

    ``a1_gs``: 0-dim (what the kernel's single activation scale really is) or ``[E]``; the alphas
    are built per expert from it, as vLLM does. ``a2_gs`` defaults to ``experts.w2_input_gs``.
    """
    dev = experts.device
    ones = torch.ones(experts.num_experts, dtype=torch.float32, device=dev)
    a1 = torch.as_tensor(a1_gs, dtype=torch.float32).to(dev) * ones
    a2 = experts.w2_input_gs if a2_gs is None else torch.as_tensor(a2_gs, dtype=torch.float32)
    a2 = a2.to(dev) * ones
    # ModelOpt stores the inverse scales; vLLM multiplies them (modelopt.py:1308-1323).
    g1_alphas = ((1 / a1) * (1 / experts.w13_weight_gs)).to(torch.float32)
    g2_alphas = ((1 / a2) * (1 / experts.w2_weight_gs)).to(torch.float32)
    w13 = torch.cat([experts.w3, experts.w1], dim=1)
    w13_sf = torch.cat([experts.w3_sf, experts.w1_sf], dim=1)
    g1w, g1s = shuffle_gemm1(w13, w13_sf, epilogue_tile_m)
    g2w, g2s = shuffle_gemm2(experts.w2, experts.w2_sf, epilogue_tile_m)
    return {
        "gemm1_weights": g1w, "gemm1_weights_scale": g1s,
        "gemm2_weights": g2w, "gemm2_weights_scale": g2s,
        "output1_scale_scalar": (a2 * g1_alphas).to(torch.float32),
        "output1_scale_gate_scalar": g1_alphas,
        "output2_scale_scalar": g2_alphas,
    }
