# SPDX-License-Identifier: Apache-2.0
"""Emulator of FlashInfer 0.3.1 ``flashinfer.fused_moe.cutlass_fused_moe`` (NVFP4 and bf16/fp16).

Why: the bug this project fixes lives in the contract between vLLM 0.11.0 and this kernel, which
only runs on SM100. The emulator reproduces the kernel's *scale bookkeeping* exactly, so CPU tests
can show the stock mismatch and prove the fix. Citations (FlashInfer 0.3.1 wheel; C++ under
``flashinfer/data/csrc/``): ``fi.core`` = ``flashinfer/fused_moe/core.py``, ``fi.ops`` =
``fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_sm100_ops.cu``, ``fi.kern`` =
``fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh``.

What the kernel does, per routed (token, k) pair whose GLOBAL expert id falls in this rank's
``[E_local*ep_rank, E_local*(ep_rank+1))`` (fi.ops:301-303, fi.kern:1789-1792, 1936-1938):

1. FC1 input. bf16/fp16 input: quantized per permuted row with
   ``fc1_act_global[e if dim()==1 else 0]``, e the LOCAL expert (fi.kern:1511-1530).
   uint8 FP4 input: codes are copied and the SF is read from ``input_sf`` (128x4 layout of the
   unpermuted rows, indexed by source row); the act global scale is NOT used (fi.kern:1534-1540).
2. GEMM1 ``[M_e, 2I] = (sum_k e2m1(a)*sf_a * e2m1(w)*sf_w) * fc1_global[e]`` -- the alpha is
   the only dequant factor (fi.kern:1220-1222); nothing divides by the act global scale. Output
   is stored in the output dtype (``UnfusedGemmOutputType = BackBoneType = OutputType``,
   ``moe_kernels.h:576``).
3. SwiGLU: rows ``[0, I)`` are the linear (w3/up) half, ``[I, 2I)`` the gate (w1) half;
   ``silu(gate) * up`` in fp32 (fi.kern:2233-2250, ``GLUAdaptor`` 2018-2029; ``swiglu_alpha/
   beta/limit`` select ``SwigluBiasAdaptor`` 2031-2044, fi.ops:304-324). Non-gated Relu2
   (FlashInfer 0.7.4, read: ``activation="relu2"`` here): fc1 has ``I`` rows (the binding's
   ``fc1_n_mult`` is 1, flashinfer_cutlass_fused_moe_binding.cu:1496-1521) and ``relu(h)^2`` is
   applied to each GEMM1 output (``IdentityAdaptor<Relu2>``, ``doActivationKernel`` with
   ``IsGated`` false: no gate offset, cutlass_fused_moe_kernels.cuh:2452-2560, fused_activations.h
   ``Relu2``); alphas and the FC2 quantization are the gated path's.
4. The fp32 activation is cast to the output dtype and FP4-quantized with
   ``fc2_act_global[e if dim()==1 else 0]`` (fi.kern:2197-2201, ``quantizePackedFPXValue``
   957-975 converts to ``GemmOutputType`` first).
5. GEMM2 likewise with ``fc2_global[e]``, stored in the output dtype.
6. Finalize: ``out[t] = sum_k scale[t,k] * float(gemm2[t,k])`` over local experts, k in order,
   in fp32, cast to the output dtype (fi.kern:1751-1823). Non-local experts contribute nothing.

Emulation choices: block-scaled products ``e2m1*sf`` are exact in fp32; we accumulate them in
fp64, so a GEMM result is the exact sum rounded once to fp32 (independent of summation order and
sharding), then multiplied by alpha in fp32. Tensor cores accumulate in fp32 in an unspecified
order, so real outputs can differ by fp32 rounding. Biases, all-to-all, min-latency, W4A8 and
MXFP8 modes are not emulated (they raise).
"""

from __future__ import annotations

from typing import Optional

import torch

from .constants import BLOCK_SIZE
from .e2m1 import e2m1_decode, unpack_fp4
from .layout import unswizzle_128x4
from .quantize import quantize_codes

_HALF_TYPES = (torch.float16, torch.bfloat16)


def _align(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _check_shape_dtype_device(x, shape, dtype, device, name):
    # Mirrors flashinfer/utils.py:473-491 (called at fi.core:881-883).
    if shape and x.shape != torch.Size(shape):
        raise ValueError(f"Invalid shape of {name}: expected {shape}, got {x.shape}")
    if dtype and x.dtype != dtype:
        raise ValueError(f"Invalid dtype of {name}: expected {dtype}, got {x.dtype}")
    if device and x.device != device:
        raise ValueError(f"Invalid device of {name}: expected {device}, got {x.device}")


def _check(cond: bool, msg: str) -> None:
    # The C++ side uses TORCH_CHECK, which surfaces as RuntimeError.
    if not cond:
        raise RuntimeError(msg)


def _block_values(codes: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """e2m1(code) * float(sf) per element (exact in fp32), as fp64 for exact accumulation."""
    vals = e2m1_decode(codes)
    k = vals.shape[-1]
    vb = vals.reshape(*vals.shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
    return (vb * sf.float().unsqueeze(-1)).reshape(vals.shape).double()


def _scaled_gemm(a_vals: torch.Tensor, w_vals: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    return (a_vals @ w_vals.transpose(-2, -1)).float() * alpha


def _swiglu(gate, up, e, swiglu_alpha, swiglu_beta, swiglu_limit):
    if swiglu_alpha is None and swiglu_beta is None and swiglu_limit is None:
        return gate * torch.sigmoid(gate) * up
    alpha = swiglu_alpha[e].float() if swiglu_alpha is not None else 1.0
    beta = swiglu_beta[e].float() if swiglu_beta is not None else 0.0
    limit = swiglu_limit[e].float() if swiglu_limit is not None else float("inf")
    limit = torch.as_tensor(limit, dtype=torch.float32, device=gate.device)
    lin = torch.maximum(torch.minimum(up, limit), -limit)
    g = torch.minimum(gate, limit)
    return g * torch.sigmoid(g * alpha) * (lin + beta)


def _act_scale(scale: torch.Tensor, e: int) -> torch.Tensor:
    return scale[e] if scale.dim() == 1 else scale


def _bytes_behind_pointer(input_sf: torch.Tensor, m: int, ks: int) -> torch.Tensor:
    """The swizzled SF bytes the kernel reads for ``m`` rows, as the kernel reads them.

    The binding passes only ``input_sf.data_ptr()`` to the kernel (fi.ops:351, 368 in 0.3.1;
    fi 0.5.3 flashinfer_cutlass_fused_moe_sm100_binding.cu:386), with no shape check. vLLM 0.12.0
    hands it ``a1q_scale[0:M]`` of the 1-D interleaved buffer (modular_kernel.py:1134,
    _slice_scales, even with one chunk); on the GPU that is harmless because the storage behind the
    pointer is whole. So when the view is shorter than the 128x4 buffer, read the same bytes from
    its storage, and fail only where the real kernel would read past the allocation.
    """
    raw = input_sf.view(torch.uint8) if input_sf.dtype.itemsize == 1 else input_sf
    need = ((m + 127) // 128 * 128) * ((ks + 3) // 4 * 4)
    if raw.numel() >= need or not raw.is_contiguous():
        return raw.contiguous().reshape(-1)
    storage = raw.untyped_storage()
    if storage.nbytes() - raw.storage_offset() < need:
        raise ValueError(f"input_sf's storage holds {storage.nbytes() - raw.storage_offset()} "
                         f"bytes after its pointer; the kernel reads {need} for {m} rows")
    return torch.empty(0, dtype=torch.uint8, device=raw.device).set_(
        storage, raw.storage_offset(), (need,))


def _nvfp4_operands(input, input_sf, fc1, fc2, quant_scales, e_local, gated=True):
    """Validate like fi.ops:914-969 and return decoded weights + scales."""
    w1 = fc1.view(torch.uint8) if fc1.dtype == torch.int64 else fc1
    w2 = fc2.view(torch.uint8) if fc2.dtype == torch.int64 else fc2
    _check(w1.dtype == torch.uint8 and w2.dtype == torch.uint8,
           f"NVFP4 weights must be int64 (or uint8) views, got {fc1.dtype}/{fc2.dtype}")
    hidden, inter = w2.shape[1], w2.shape[2] * 2
    mult = 2 if gated else 1  # the binding's fc1_n_mult
    _check(w1.shape[1] == mult * inter,
           "fc1_expert_weights inter size must be 2 times fc2_expert_weights inter size."
           if gated else
           "fc1_expert_weights inter size must be equal to fc2_expert_weights inter size.")
    _check(w1.shape[2] * 2 == hidden, "fc1 K (packed) must equal hidden_size / 2")
    _check(quant_scales is not None and len(quant_scales) == 6,
           "Expecting 6 quant scales for nvfp4 quantization")
    a1, w1_block, g1, a2, w2_block, g2 = quant_scales
    expected = ((a1, torch.float32, "fc1 act global"), (w1_block, torch.int32, "fc1 weight block"),
                (g1, torch.float32, "fc1 global"), (a2, torch.float32, "fc2 act global"),
                (w2_block, torch.int32, "fc2 weight block"), (g2, torch.float32, "fc2 global"))
    for t, dt, name in expected:
        _check(t.dtype == dt, f"{name} must be {dt}, got {t.dtype}")
    for t, name in ((a1, "fc1 act global"), (a2, "fc2 act global")):
        _check(t.dim() == 0 or (t.dim() == 1 and t.shape[0] == e_local),
               f"{name} must be scalar or (num_experts_on_rank,)")
    for t, name in ((g1, "fc1 global"), (g2, "fc2 global")):
        _check(t.dim() == 1 and t.shape[0] == e_local,
               f"{name} size must be (num_experts_on_rank,)")
    # fi.ops:932-961: SF rows/cols padded to the SF atom (128 rows, 64 elements of K).
    _check(w1_block.dim() == 3 and tuple(w1_block.shape) == (
        e_local, _align(inter, 64) * mult, _align(hidden, 64) // 64),
        f"fc1 weight block size must be (num_experts_on_rank, inter_size{' * 2' * gated}, "
        "hidden_size // 4 // block_scale_vector_size)")
    _check(w2_block.dim() == 3 and tuple(w2_block.shape) == (
        e_local, _align(hidden, 128), _align(inter, 64) // 64),
        "fc2 weight block size must be (num_experts_on_rank, hidden_size, inter_size // 4 // "
        "block_scale_vector_size)")
    w1_sf = unswizzle_128x4(w1_block.view(torch.uint8), mult * inter, hidden // BLOCK_SIZE)
    w2_sf = unswizzle_128x4(w2_block.view(torch.uint8), hidden, inter // BLOCK_SIZE)
    w1_vals = _block_values(unpack_fp4(w1), w1_sf.view(torch.float8_e4m3fn))
    w2_vals = _block_values(unpack_fp4(w2), w2_sf.view(torch.float8_e4m3fn))

    if input.dtype == torch.uint8:
        _check(input.shape[1] * 2 == hidden, "FP4 input must be [num_tokens, hidden_size / 2]")
        if input_sf is None:
            raise ValueError("FP4 input needs input_sf (the real kernel would read zero scales)")
        in_sf = unswizzle_128x4(_bytes_behind_pointer(input_sf, input.shape[0],
                                                      hidden // BLOCK_SIZE),
                                input.shape[0], hidden // BLOCK_SIZE)
        in_vals = _block_values(unpack_fp4(input), in_sf.view(torch.float8_e4m3fn))
    elif input.dtype in _HALF_TYPES:
        _check(input.shape[1] == hidden, "input must be [num_tokens, hidden_size]")
        in_vals = None
    else:
        raise ValueError(f"NVFP4 MoE takes fp16/bf16 or packed uint8 input, got {input.dtype}")
    return w1_vals, w2_vals, in_vals, (a1, g1, a2, g2), inter


def cutlass_fused_moe(
    input: torch.Tensor,
    token_selected_experts: torch.Tensor,
    token_final_scales: torch.Tensor,
    fc1_expert_weights: torch.Tensor,
    fc2_expert_weights: torch.Tensor,
    output_dtype: torch.dtype,
    quant_scales: list[torch.Tensor],
    fc1_expert_biases: Optional[torch.Tensor] = None,
    fc2_expert_biases: Optional[torch.Tensor] = None,
    input_sf: Optional[torch.Tensor] = None,
    swiglu_alpha: Optional[torch.Tensor] = None,
    swiglu_beta: Optional[torch.Tensor] = None,
    swiglu_limit: Optional[torch.Tensor] = None,
    tp_size: int = 1,
    tp_rank: int = 0,
    ep_size: int = 1,
    ep_rank: int = 0,
    cluster_size: int = 1,
    cluster_rank: int = 0,
    output: Optional[torch.Tensor] = None,
    enable_alltoall: bool = False,
    use_deepseek_fp8_block_scale: bool = False,
    use_w4_group_scaling: bool = False,
    use_mxfp8_act_scaling: bool = False,
    min_latency_mode: bool = False,
    tune_max_num_tokens: int = 8192,
    enable_pdl: Optional[bool] = None,
    activation: str = "swiglu",
) -> list[torch.Tensor]:
    """Same signature as FlashInfer 0.3.1 (fi.core:709-734), plus ``activation`` ("swiglu", or
    "relu2": non-gated, what FlashInfer 0.7.x's ``activation_type=Relu2`` selects). Like the real
    function it returns a one-element LIST ``[output]`` (fi.core:653, despite its annotation).
    ``tune_max_num_tokens`` / ``enable_pdl`` are perf-only; ``tp_size/tp_rank`` only gate biases
    (fi.kern:1936-1937), which are not emulated, so weights must already be TP-sharded."""
    if activation not in ("swiglu", "relu2"):
        raise NotImplementedError(f"activation {activation!r} is not emulated")
    gated = activation == "swiglu"
    if use_deepseek_fp8_block_scale:
        raise NotImplementedError(
            "DeepSeek FP8 Block Scaling is not yet implemented in CUTLASS for Blackwell.")
    if min_latency_mode:
        raise NotImplementedError("min latency mode not yet implemented for Blackwell.")
    num_rows = input.shape[0]
    hidden = fc2_expert_weights.shape[1]
    if output is None:
        output = torch.empty((num_rows, hidden), dtype=output_dtype, device=input.device)
    else:
        _check_shape_dtype_device(output, (num_rows, hidden), output_dtype, input.device, "output")
    if fc1_expert_biases is not None or fc2_expert_biases is not None:
        raise NotImplementedError("expert biases are not emulated")
    if enable_alltoall or use_w4_group_scaling or use_mxfp8_act_scaling:
        raise NotImplementedError("all-to-all, W4 group scaling and MXFP8 modes are not emulated")
    _check(cluster_size == 1 and cluster_rank == 0, "smart_router is supported in min_latency mode")
    _check(0 <= ep_rank < ep_size and 0 <= tp_rank < tp_size, "invalid tp/ep rank")
    _check(token_selected_experts.dtype == torch.int32, "token_selected_experts must be int32")
    _check(input.dim() == 2 and token_selected_experts.dim() == 2, "input/token ids must be 2D.")
    _check(fc1_expert_weights.dim() == 3 and fc2_expert_weights.dim() == 3, "weights must be 3D.")
    _check(input.shape[0] == token_selected_experts.shape[0],
           "input and token_selected_experts must have the same num tokens.")
    if token_final_scales is not None:
        _check(token_final_scales.dtype == torch.float32, "token_final_scales must be float32")
        _check(token_final_scales.shape == token_selected_experts.shape,
               "token_final_scales must match token_selected_experts")
    e_local = fc2_expert_weights.shape[0]
    _check(fc1_expert_weights.shape[0] == e_local, "fc1/fc2 must have the same number of experts.")
    for t, name in ((swiglu_alpha, "swiglu_alpha"), (swiglu_beta, "swiglu_beta"),
                    (swiglu_limit, "swiglu_limit")):
        if t is not None:
            _check(t.dtype == torch.float32 and t.shape[0] == e_local,
                   f"{name} must have num_experts_on_rank elements.")

    nvfp4 = fc1_expert_weights.dtype in (torch.int64, torch.uint8)
    if nvfp4:
        _check(output_dtype in _HALF_TYPES, f"Invalid output type {output_dtype} for NVFP4 MoE")
        w1_vals, w2_vals, in_vals, (a1, g1, a2, g2), inter = _nvfp4_operands(
            input, input_sf, fc1_expert_weights, fc2_expert_weights, quant_scales, e_local,
            gated)
    else:
        _check(input.dtype in _HALF_TYPES and fc1_expert_weights.dtype == input.dtype
               and fc2_expert_weights.dtype == input.dtype and output_dtype == input.dtype,
               "Could not construct fused moe op with the requested input combination")
        _check(not quant_scales, "unquantized MoE takes no quant_scales")
        inter = fc2_expert_weights.shape[2]
        _check(fc1_expert_weights.shape[1] == (2 if gated else 1) * inter,
               "fc1_expert_weights inter size must be 2 times fc2_expert_weights inter size.")

    act_dtype = output_dtype  # GemmOutputType == OutputType for every emulated runner
    top_k = token_selected_experts.shape[1]
    start = e_local * ep_rank
    results = torch.zeros((num_rows, top_k, hidden), dtype=act_dtype, device=input.device)
    local = torch.zeros((num_rows, top_k), dtype=torch.bool, device=input.device)
    ids = token_selected_experts.long()
    for e in range(e_local):
        tok, kk = torch.nonzero(ids == start + e, as_tuple=True)
        if tok.numel() == 0:
            continue
        local[tok, kk] = True
        if nvfp4:
            if in_vals is not None:
                a_vals = in_vals[tok]
            else:
                codes, sf = quantize_codes(input[tok], _act_scale(a1, e))
                a_vals = _block_values(codes, sf)
            h = _scaled_gemm(a_vals, w1_vals[e], g1[e]).to(act_dtype).float()
        else:
            h = (input[tok].float() @ fc1_expert_weights[e].float().t()).to(act_dtype).float()
        if gated:
            up, gate = h[:, :inter], h[:, inter:]
            act = _swiglu(gate, up, e, swiglu_alpha, swiglu_beta, swiglu_limit).to(act_dtype)
        else:
            act = torch.relu(h).square().to(act_dtype)
        if nvfp4:
            codes2, sf2 = quantize_codes(act, _act_scale(a2, e))
            y = _scaled_gemm(_block_values(codes2, sf2), w2_vals[e], g2[e])
        else:
            y = act.float() @ fc2_expert_weights[e].float().t()
        results[tok, kk] = y.to(act_dtype)

    scales = (token_final_scales if token_final_scales is not None
              else torch.ones((num_rows, top_k), dtype=torch.float32, device=input.device))
    acc = torch.zeros((num_rows, hidden), dtype=torch.float32, device=input.device)
    for k in range(top_k):
        contrib = scales[:, k:k + 1].float() * results[:, k].float()
        acc = acc + torch.where(local[:, k:k + 1], contrib, torch.zeros_like(contrib))
    output.copy_(acc.to(output_dtype))
    return [output]
