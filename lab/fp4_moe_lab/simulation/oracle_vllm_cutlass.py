# SPDX-License-Identifier: Apache-2.0
"""vLLM's own CUTLASS NVFP4 MoE kernel (``--moe-backend cutlass``, ``NvFp4MoeBackend.
VLLM_CUTLASS``, ``CutlassExpertsFp4``) on CPU: torch stand-ins for the ``vllm._C`` /
``_moe_C`` ops ``run_cutlass_moe_fp4`` calls, the Triton route remap it calls under EP, and
the experts' device probe without ``is_cuda()``. Part of the seam :mod:`.blackwell_oracle`
installs (``backend="vllm_cutlass"``; its docstring lists every symbol replaced and why).

Citations: ``v0.34.0 path:line`` (paths under ``vllm/``; FM = model_executor/layers/fused_moe)
for the Python callers and op wrappers, which define shapes, dtypes and what is read back;
``csrc path`` for the CUDA contract, read at vLLM commit cc786bf (moe_data.cu) and 0328802
(nvfp4_experts_quant.cu), the newest in the source mirror (0.34.0's csrc is not shipped in its
wheel): the 0.34.0 wrappers add ``is_gated`` (GEMM1 N = 2n or n) and the fused SiLU+Mul variant
of the experts quantizer, which these functions follow from the Python side.

Why vLLM's CUTLASS keeps per-expert activation scales: it is not a global-sf backend
(FM/oracle/nvfp4.py:69-83, ``is_global_sf_supported_for_nvfp4_backend``), so
``prepare_nvfp4_moe_layer_for_fi_or_cutlass`` keeps one GEMM1 scale per LOCAL expert (the max
over w1/w3, Q/utils/flashinfer_fp4_moe.py:496-506) and GEMM2's per local expert, and the
experts quantize after dispatch (``expects_unquantized_inputs``, FM/experts/cutlass_moe.py:
719-721), each row with its own expert's scale (``scaled_fp4_experts_quant``).

Numerics: the quantizer is the kernel-order one (:func:`nvfp4.quantize_codes`, ``flashinfer``
convention, the same ``cvt_warp_fp16_to_fp4`` vLLM's csrc nvfp4_utils.cuh carries); GEMMs
accumulate the exact block-scaled products in fp64, round once to fp32, times alpha, stored in
the output dtype (as :mod:`.nvfp4.fused_moe_emulator`). SM100 and SM120 kernels take the same
operands; their tile-level numerics are not emulated.
"""

from __future__ import annotations

from typing import Optional

import torch

from fp4_moe_lab import nvfp4
from fp4_moe_lab.nvfp4.constants import BLOCK_SIZE
from fp4_moe_lab.nvfp4.fused_moe_emulator import _block_values, _scaled_gemm

_CUTLASS_MOE = "vllm.model_executor.layers.fused_moe.experts.cutlass_moe"
_SF_ROW_PAD = 128  # rows of one 128x4 tile: each expert's block-scale rows are padded to it


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def vllm_cutlass_supports_current_device() -> bool:
    """``CutlassExpertsFp4._supports_current_device`` (v0.34.0 FM/experts/cutlass_moe.py:
    723-730) without ``is_cuda()``: the 10.x and 12.x families, as on the reported GPU."""
    from vllm.platforms import current_platform as p

    return bool(p.is_device_capability_family(100) or p.is_device_capability_family(120))


def poisoned(get_simultaneous):
    """``WorkspaceManager.get_simultaneous`` whose views start as NaN (floating dtypes): memory
    nobody initialised, poisoned as a debugging allocator does (module docstring of
    :mod:`.blackwell_oracle`)."""
    def get(self, *shapes_and_dtypes):
        views = get_simultaneous(self, *shapes_and_dtypes)
        for view in views:
            if view.is_floating_point():
                view.fill_(float("nan"))
        return views
    return get


def remap_topk_to_local(topk_ids: torch.Tensor, expert_map: torch.Tensor, *,
                        out_dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """v0.34.0 FM/utils.py:262-299 (a Triton kernel) in torch: the formula its docstring gives,
    ``where(topk_ids >= 0, expert_map[topk_ids.clamp(min=0)], -1)``; a new tensor."""
    if out_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"out_dtype must be int32 or int64, got {out_dtype}")
    ids = topk_ids.long()
    local = expert_map.long()[ids.clamp(min=0)]
    return torch.where(ids >= 0, local, torch.full_like(local, -1)).to(out_dtype)


def get_cutlass_moe_mm_data(topk_ids: torch.Tensor, expert_offsets: torch.Tensor,
                            problem_sizes1: torch.Tensor, problem_sizes2: torch.Tensor,
                            input_permutation: torch.Tensor, output_permutation: torch.Tensor,
                            num_experts: int, n: int, k: int,
                            blockscale_offsets: Optional[torch.Tensor] = None,
                            is_gated: bool = True,
                            sorted_expert_ids: Optional[torch.Tensor] = None) -> None:
    """``ops.get_cutlass_moe_mm_data`` (v0.34.0 _custom_ops.py:838-891), in place, as csrc
    quantization/w8a8/cutlass/moe/moe_data.cu ``get_cutlass_moe_mm_data_caller`` writes it for
    the FP4 path (``blockscale_offsets`` given: never swap-AB):

    * ``problem_sizes1[e] = (m_e, 2n or n, k)``, ``problem_sizes2[e] = (m_e, k, n)``, ``m_e`` the
      routes to local expert ``e`` (``compute_problem_sizes``);
    * ``expert_offsets``: exclusive prefix sum of ``m_e``; ``blockscale_offsets``: the same with
      each ``m_e`` rounded up to 128 (``compute_expert_blockscale_offsets``);
    * ``input_permutation[row] = route // topk`` and ``output_permutation[route] = row`` with the
      routes of one expert contiguous from its offset (``compute_arg_sorts``; the kernel's order
      inside an expert comes from atomics, here route order: rows are independent); a route
      with id -1 (not local, FM/utils.py:268) gets ``output_permutation = expert_offsets[E]``.

    ``input_permutation[expert_offsets[E]:]`` is left unwritten by the kernel (whatever the
    allocator holds); here it is set to 0 so the CPU gather stays in range. Those rows are never
    read by a GEMM (each covers only its expert's rows)."""
    if sorted_expert_ids is not None:
        raise NotImplementedError("sorted_expert_ids (MXFP4 path) is not emulated")
    ids = topk_ids.reshape(-1).long()
    topk = topk_ids.shape[1]
    counts = torch.stack([(ids == e).sum() for e in range(num_experts)]).to(torch.int32)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int32)
    offsets[1:] = torch.cumsum(counts, 0)
    n1 = 2 * n if is_gated else n
    problem_sizes1.copy_(torch.stack([counts, torch.full_like(counts, n1),
                                      torch.full_like(counts, k)], dim=1))
    problem_sizes2.copy_(torch.stack([counts, torch.full_like(counts, k),
                                      torch.full_like(counts, n)], dim=1))
    expert_offsets.copy_(offsets)
    if blockscale_offsets is not None:
        padded = (counts + _SF_ROW_PAD - 1) // _SF_ROW_PAD * _SF_ROW_PAD
        bso = torch.zeros(num_experts + 1, dtype=torch.int32)
        bso[1:] = torch.cumsum(padded, 0)
        blockscale_offsets.copy_(bso)
    total = int(offsets[-1])
    in_perm = torch.zeros(input_permutation.numel(), dtype=torch.int32)
    out_perm = torch.full((ids.numel(),), total, dtype=torch.int32)  # -1 routes
    for e in range(num_experts):
        routes = torch.nonzero(ids == e).reshape(-1)
        rows = torch.arange(int(offsets[e]), int(offsets[e]) + routes.numel(), dtype=torch.int32)
        in_perm[rows.long()] = (routes // topk).to(torch.int32)
        out_perm[routes] = rows
    unknown = (ids != -1) & ((ids < 0) | (ids >= num_experts))
    if bool(unknown.any()):
        raise ValueError("topk_ids hold expert ids outside [-1, num_experts)")
    input_permutation.copy_(in_perm)
    output_permutation.copy_(out_perm)


def shuffle_rows(input_tensor: torch.Tensor, dst2src_map: torch.Tensor) -> torch.Tensor:
    """``ops.shuffle_rows`` (v0.34.0 _custom_ops.py:913-924): a new ``[len(map), cols]``
    tensor, row ``i`` = ``input_tensor[dst2src_map[i]]``."""
    return input_tensor[dst2src_map.long()].clone()


def _experts_quant_buffers(x: torch.Tensor, k: int, topk: int):
    """The wrapper's outputs (v0.34.0 _custom_ops.py:1578-1600): packed codes ``[m_topk, k/2]``
    and an int32 block-scale buffer ``[MAX_TOKENS_PER_EXPERT * topk, ceil(k/16 / 4)]``, viewed
    as float8 on return. Zeroed here; the GPU's is uninitialized outside the rows written."""
    import vllm.envs as envs

    max_tokens = envs.VLLM_MAX_TOKENS_PER_EXPERT_FP4_MOE
    m_topk = x.shape[0]
    assert m_topk <= max_tokens * topk, "m_numtopk must be less than MAX_TOKENS_PER_EXPERT"
    padded_k = (k // BLOCK_SIZE + 3) // 4
    out = torch.zeros(m_topk, k // 2, dtype=torch.uint8, device=x.device)
    scales = torch.zeros(max_tokens * topk, padded_k, dtype=torch.int32, device=x.device)
    return out, scales


def _quantize_per_expert(x: torch.Tensor, global_scale: torch.Tensor,
                         expert_offsets: torch.Tensor, blockscale_offsets: torch.Tensor,
                         topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """csrc quantization/fp4/nvfp4_experts_quant.cu ``cvt_fp16_to_fp4``: row ``r`` of expert
    ``e`` (``expert_offsets[e] <= r < expert_offsets[e+1]``) is quantized with
    ``global_scale[e]``; its block scales go to the expert's region, which starts at row
    ``blockscale_offsets[e]`` of the scale buffer, in the 128x4 swizzled layout of an
    ``[m_e, k/16]`` matrix (``cvt_quant_to_fp4_get_sf_out_offset`` with the row inside the
    expert). Rows past ``expert_offsets[E]`` (routes to no local expert) are not written: the
    kernel read files them under expert 0 at row 0 of its scale block, racing with that row's
    own scales on a GPU; not emulated (their outputs are discarded, csrc moe_data.cu
    ``compute_arg_sorts``, if that race leaves expert 0 whole)."""
    k = x.shape[1]
    if k % BLOCK_SIZE:
        raise RuntimeError("k must be a multiple of 16")
    n_experts = global_scale.shape[0]
    if expert_offsets.shape[0] != n_experts + 1 or blockscale_offsets.shape[0] != n_experts + 1:
        raise RuntimeError("expert_offsets and blockscale_offsets must hold n_experts + 1")
    out, scales = _experts_quant_buffers(x, k, topk)
    sf_bytes = scales.view(torch.uint8)  # [rows, 4 * padded_k]: one row of scales per token
    gs = global_scale.float()
    for e in range(n_experts):
        lo, hi = int(expert_offsets[e]), int(expert_offsets[e + 1])
        if hi == lo:
            continue
        codes, sf = nvfp4.quantize_codes(x[lo:hi].float(), gs[e], convention="flashinfer")
        out[lo:hi] = nvfp4.pack_fp4(codes)
        swz = nvfp4.swizzle_128x4(sf.view(torch.uint8))  # [pad128(m_e), pad4(ks)]
        row = int(blockscale_offsets[e])
        sf_bytes[row:row + swz.shape[0], :swz.shape[1]] = swz
    return out, scales.view(torch.float8_e4m3fn)


def scaled_fp4_experts_quant(input_tensor: torch.Tensor, input_global_scale: torch.Tensor,
                             expert_offsets: torch.Tensor, blockscale_offsets: torch.Tensor,
                             topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.scaled_fp4_experts_quant`` (v0.34.0 _custom_ops.py:1548-1609): NVFP4 codes
    ``[m_topk, k/2]`` and float8 block scales per expert (see :func:`_quantize_per_expert`);
    ``input_global_scale``: one per local expert, ``[E]``."""
    assert input_tensor.ndim == 2, f"input.ndim needs to be == 2, but got {input_tensor.ndim}."
    return _quantize_per_expert(input_tensor, input_global_scale, expert_offsets,
                                blockscale_offsets, topk)


def silu_and_mul_scaled_fp4_experts_quant(input_tensor: torch.Tensor,
                                          input_global_scale: torch.Tensor,
                                          expert_offsets: torch.Tensor,
                                          blockscale_offsets: torch.Tensor,
                                          topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``ops.silu_and_mul_scaled_fp4_experts_quant`` (v0.34.0 _custom_ops.py:1612-1674): input
    ``gate || up`` ``[m_topk, 2k]`` (docstring :1622; vLLM's CUTLASS keeps the checkpoint's
    [w1; w3] order, only FlashInfer's kernels reorder, Q/utils/flashinfer_fp4_moe.py:481-493),
    ``silu(gate) * up`` in fp32 rounded to the input dtype (csrc nvfp4_utils.cuh
    ``compute_silu_mul`` returns a packed vector of the input type), then quantized per expert
    like :func:`scaled_fp4_experts_quant`."""
    assert input_tensor.ndim == 2, f"input.ndim needs to be == 2, but got {input_tensor.ndim}."
    width = input_tensor.shape[1]
    assert width % 2 == 0, "input width must be even (gate || up layout)"
    h = input_tensor.float()
    gate, up = h[:, :width // 2], h[:, width // 2:]
    act = (torch.nn.functional.silu(gate) * up).to(input_tensor.dtype)
    return _quantize_per_expert(act, input_global_scale, expert_offsets, blockscale_offsets,
                                topk)


def cutlass_fp4_moe_mm(out_tensors: torch.Tensor, a_tensors: torch.Tensor,
                       b_tensors: torch.Tensor, a_scales: torch.Tensor, b_scales: torch.Tensor,
                       alphas: torch.Tensor, problem_sizes: torch.Tensor,
                       expert_offsets: torch.Tensor, sf_offsets: torch.Tensor) -> None:
    """``ops.cutlass_fp4_moe_mm`` (v0.34.0 _custom_ops.py:1001-1037, ``_C.cutlass_fp4_group_mm``;
    csrc quantization/fp4/nvfp4_blockwise_moe_kernel.cu and _sm120_kernels.cu), in place: for
    each expert ``e`` with ``problem_sizes[e] = (m, N, K)``,
    ``out[off:off+m] = alphas[e] * (A_e @ B_e^T)`` in ``out``'s dtype, where ``A_e`` is rows
    ``off = expert_offsets[e]`` .. ``off+m`` of ``a_tensors`` (packed NVFP4, ``[*, K/2]``) with
    the block scales of ``a_scales`` from row ``sf_offsets[e]`` (128x4-swizzled ``[m, K/16]``,
    as :func:`scaled_fp4_experts_quant` writes them), and ``B_e`` is ``b_tensors[e]``
    (``[N, K/2]``) with ``b_scales[e]`` (``[pad128(N), pad4(K/16)]`` swizzled, what
    ``swizzle_blockscale`` made at load, Q/utils/flashinfer_fp4_moe.py:547-563). Rows of
    ``out`` outside the experts' ranges are not written."""
    a_sf = a_scales.contiguous().view(torch.uint8).reshape(-1)
    for e in range(problem_sizes.shape[0]):
        m, n_out, k = (int(v) for v in problem_sizes[e])
        if m == 0:
            continue
        ks = k // BLOCK_SIZE
        off, sf_row = int(expert_offsets[e]), int(sf_offsets[e])
        mp, kp = _round_up(m, _SF_ROW_PAD), _round_up(ks, 4)
        # the expert's scale block: mp rows of the buffer's row width (pad4(K/16) bytes)
        block = a_sf[sf_row * kp:(sf_row + mp) * kp]
        sf_a = nvfp4.unswizzle_128x4(block, m, ks).view(torch.float8_e4m3fn)
        a_vals = _block_values(nvfp4.unpack_fp4(a_tensors[off:off + m]), sf_a)
        sf_b = nvfp4.unswizzle_128x4(b_scales[e].view(torch.uint8), n_out, ks)
        sf_b = sf_b.view(torch.float8_e4m3fn)
        b_vals = _block_values(nvfp4.unpack_fp4(b_tensors[e][:n_out]), sf_b)
        y = _scaled_gemm(a_vals, b_vals, alphas[e].float())
        out_tensors[off:off + m] = y.to(out_tensors.dtype)


#: ``vllm._custom_ops`` name -> stand-in, replaced by the seam for ``backend="vllm_cutlass"``
OPS = {"get_cutlass_moe_mm_data": get_cutlass_moe_mm_data, "shuffle_rows": shuffle_rows,
       "scaled_fp4_experts_quant": scaled_fp4_experts_quant,
       "silu_and_mul_scaled_fp4_experts_quant": silu_and_mul_scaled_fp4_experts_quant,
       "cutlass_fp4_moe_mm": cutlass_fp4_moe_mm}
