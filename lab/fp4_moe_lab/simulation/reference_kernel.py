# SPDX-License-Identifier: Apache-2.0
"""A stand-in for ``cutlass_fused_moe`` that computes the *ideal* NVFP4 answer.

Used for the engine end-to-end reference: the same engine, the same weights, but every MoE
layer computes the plain loop-over-experts oracle (:func:`nvfp4.moe_reference_nvfp4`) from the
tensors vLLM hands the kernel, instead of going through the emulator's kernel model. It
rebuilds checkpoint-semantics experts from the kernel arguments (``[w3; w1]`` rows, swizzled
block scales, ``ws2_e = g1_alpha_e * a1_gs_e``), which is only possible when the activation
scales are per expert and the input is bf16 -- i.e. the plugin's TP-like path.

The NVFP4-oracle design (vLLM 0.14.0+) hands FlashInfer CUTLASS pre-quantized activations in
every layout (``no_dp_ep`` quantizes next to the kernel, the DP dispatchers on the sender), so
its seam (``blackwell_oracle.simulated_blackwell(kernel="reference")``) uses
:func:`reference_cutlass_fused_moe_prequantized`: the received codes and block scales are
decoded with the kernel's own GEMM1 activation scale, then the same ideal loop runs. That is
the ideal answer only when the rank that quantized used that same scale -- what the plugin's
EP-group agreement guarantees and stock DP+EP violates -- so, as in the 0.11.x world, the
reference engine runs with the plugin on.

:func:`shadow_cutlass_fused_moe` runs both on every call: the emulator's output goes on through
the engine, the oracle's is computed from the same arguments and the relative error is printed
(``SHADOW_PREFIX`` lines). Comparing two engines' greedy tokens compounds any rounding-level
difference between runs through NVFP4 activation rounding (the tiny random model's logits are
nearly flat); comparing call by call on identical inputs does not.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import torch

from fp4_moe_lab.nvfp4 import (
    QuantizedExperts,
    dequantize,
    moe_reference_nvfp4,
    unswizzle_128x4,
)


def _per_expert(t: torch.Tensor, n: int) -> torch.Tensor:
    t = t.float().reshape(-1)
    return t.expand(n).contiguous() if t.numel() == 1 else t


def experts_from_kernel_args(fc1, fc2, quant_scales) -> QuantizedExperts:
    a1_gs, w1_sf, g1_alpha, a2_gs, w2_sf, g2_alpha = quant_scales
    w13 = fc1.view(torch.uint8)
    w2 = fc2.view(torch.uint8)
    e, rows, h_half = w13.shape
    inter, hidden = w2.shape[2] * 2, w2.shape[1]
    sf13 = unswizzle_128x4(w1_sf.view(torch.float8_e4m3fn), rows, hidden // 16)
    sf2 = unswizzle_128x4(w2_sf.view(torch.float8_e4m3fn), hidden, inter // 16)
    a1 = _per_expert(a1_gs, e)
    a2 = _per_expert(a2_gs, e)
    gated = rows == 2 * inter  # else non-gated: fc1 is the one GEMM1 projection
    halves = (dict(w1=w13[:, inter:], w1_sf=sf13[:, inter:], w3=w13[:, :inter],
                   w3_sf=sf13[:, :inter]) if gated
              else dict(w1=w13, w1_sf=sf13, w3=None, w3_sf=None))
    return QuantizedExperts(
        **halves, w2=w2, w2_sf=sf2,
        w13_weight_gs=1.0 / (g1_alpha.float() * a1), w2_weight_gs=1.0 / (g2_alpha.float() * a2),
        w13_input_gs=a1, w2_input_gs=a2)


def reference_cutlass_fused_moe(input: torch.Tensor, token_selected_experts: torch.Tensor,
                                token_final_scales: torch.Tensor, fc1_expert_weights,
                                fc2_expert_weights, output_dtype: torch.dtype, quant_scales,
                                input_sf: Optional[torch.Tensor] = None, ep_size: int = 1,
                                ep_rank: int = 0, output: Optional[torch.Tensor] = None,
                                **_ignored):
    """Same call contract as the emulator (returns ``[output]``), ideal NVFP4 numerics."""
    if input_sf is not None or input.dtype == torch.uint8:
        raise RuntimeError("the reference kernel needs bf16 input: run it with the plugin on")
    experts = experts_from_kernel_args(fc1_expert_weights, fc2_expert_weights, quant_scales)
    local = experts.num_experts
    ids = token_selected_experts.long() - ep_rank * local
    mine = (ids >= 0) & (ids < local)
    weights = torch.where(mine, token_final_scales.float(), torch.zeros_like(token_final_scales))
    ids = torch.where(mine, ids, torch.zeros_like(ids))
    a1 = quant_scales[0].float()
    out = moe_reference_nvfp4(input, experts, weights, ids,
                              a1_gs=a1 if a1.dim() == 0 else experts.w13_input_gs,
                              a2_gs=experts.w2_input_gs, intermediate_dtype=output_dtype)
    out = out.to(output_dtype)
    if output is not None:
        output.copy_(out)
        out = output
    return [out]


def reference_cutlass_fused_moe_prequantized(input: torch.Tensor, token_selected_experts,
                                             token_final_scales, fc1_expert_weights,
                                             fc2_expert_weights, output_dtype, quant_scales,
                                             input_sf: Optional[torch.Tensor] = None,
                                             **kwargs):
    """:func:`reference_cutlass_fused_moe` for activations that arrive NVFP4-quantized
    (packed ``uint8 [T, H/2]`` + 128x4-swizzled block scales, the FlashInfer CUTLASS input
    contract): decode them with the kernel's GEMM1 activation scale ``quant_scales[0]`` (one
    scalar in the oracle design), in fp32, then run the ideal loop. Re-quantizing the decoded
    values with the same scale gives back the same codes and block scales (every block's
    largest code is 6, see ``nvfp4.quantize``), so the loop sees exactly the received
    activations."""
    if input.dtype != torch.uint8:
        return reference_cutlass_fused_moe(input, token_selected_experts, token_final_scales,
                                           fc1_expert_weights, fc2_expert_weights,
                                           output_dtype, quant_scales, input_sf=input_sf,
                                           **kwargs)
    if input_sf is None:
        raise RuntimeError("pre-quantized input without its block scales")
    a1 = quant_scales[0].float().reshape(-1)
    if a1.numel() > 1 and not bool((a1 == a1[0]).all()):
        raise RuntimeError("pre-quantized input with per-expert GEMM1 scales: the scale the "
                           "sender used is unknown")
    rows, hidden = input.shape[0], input.shape[1] * 2
    sf = unswizzle_128x4(input_sf.view(torch.uint8), rows, hidden // 16)
    x = dequantize(input, sf.view(torch.float8_e4m3fn), a1[0], dtype=torch.float32)
    return reference_cutlass_fused_moe(x, token_selected_experts, token_final_scales,
                                       fc1_expert_weights, fc2_expert_weights, output_dtype,
                                       quant_scales, input_sf=None, **kwargs)


SHADOW_PREFIX = "fp4_moe_shadow"
# One bf16 rounding (2**-8) relative to a call's output: the per-call noise allowed between the
# emulator and the oracle (measured <= 3.2e-4 in a TP=2 engine; a kernel that uses expert 0's
# scale for every expert is 2.9 off, tests/plugin/test_reference_kernel.py).
SHADOW_NOISE_BOUND = 2.0 ** -8


def relative_error(out: torch.Tensor, ideal: torch.Tensor) -> float:
    """||out - ideal|| / ||ideal|| in fp32 (0.0 when both are zero)."""
    ideal = ideal.float()
    den = float(ideal.norm())
    num = float((out.float() - ideal).norm())
    return num / den if den else num


def shadow_cutlass_fused_moe(*args, **kwargs):
    """The emulator's ``cutlass_fused_moe``, checked on every call against the ideal oracle on
    the same arguments. Prints ``SHADOW_PREFIX {"pid", "rows", "rel_err"}`` to stderr (vLLM's
    worker processes share the driver's stderr) and returns the emulator's ``[output]``."""
    from fp4_moe_lab.nvfp4 import cutlass_fused_moe

    ideal = reference_cutlass_fused_moe(*args, **{k: v for k, v in kwargs.items()
                                                 if k != "output"})[0]
    out = cutlass_fused_moe(*args, **kwargs)
    record = {"pid": os.getpid(), "rows": int(ideal.shape[0]),
              "rel_err": relative_error(out[0], ideal)}
    print(f"{SHADOW_PREFIX} {json.dumps(record)}", file=sys.stderr, flush=True)
    return out


def shadow_records(text: str) -> list[dict]:
    """The records :func:`shadow_cutlass_fused_moe` printed in ``text`` (a log, any prefixes)."""
    marker = SHADOW_PREFIX + " "
    return [json.loads(line.split(marker, 1)[1]) for line in text.splitlines() if marker in line]
