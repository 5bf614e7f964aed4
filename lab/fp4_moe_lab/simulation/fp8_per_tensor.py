# SPDX-License-Identifier: Apache-2.0
"""FP8 per-tensor MoE under DP+EP (outside the plugin's scope; docs/UPSTREAM.md's note): does
each EP rank collapse its experts' static input scales to a different value, as
compressed-tensors NVFP4 did before upstream/0001?

Real vLLM code in real gloo ranks: ``process_fp8_input_tensor_strategy_moe`` (v0.34.0
Q/utils/fp8_utils.py:1570-1586), the helper every FP8 MoE method with static per-tensor scales
calls after loading (Q/fp8.py:744, Q/modelopt.py:639, CT w8a8_fp8.py:279), on the rank's own
experts' scales (the loader keeps only local experts' input scales without ``use_global_sf``:
FM/routed_experts.py:764-771). What that does to a token that crosses ranks is then arithmetic,
emulated: the default dispatch quantizes on the sender with the sender's ``a1_scale``
(FM/prepare_finalize/naive_dp_ep.py:185-194, read) and the owner's experts dequantize with theirs;
``scaled_fp8_quant`` is ``clamp(x / s, +-448)`` to E4M3. No FP8 experts kernel runs here.
"""

from __future__ import annotations

import torch

NUM_EXPERTS, HIDDEN, TOKENS = 8, 256, 32
E4M3_MAX = 448.0


def input_scales(spread: float = 4.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's static GEMM1 and GEMM2 input scale as a checkpoint holds them (amax / 448),
    the amaxes ``spread`` apart across the experts in a geometric ramp."""
    amax = spread ** (torch.arange(NUM_EXPERTS, dtype=torch.float32) / (NUM_EXPERTS - 1))
    return amax / E4M3_MAX, 2.0 * amax / E4M3_MAX


def _fp8_round_trip(x: torch.Tensor, quant_scale: torch.Tensor,
                    dequant_scale: torch.Tensor) -> torch.Tensor:
    q = (x.float() / quant_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.float() * dequant_scale


def collapsed_scales(ctx, spread: float = 4.0) -> dict:
    """Job: this EP rank's collapsed GEMM1 scale without and with EPLB (vLLM's own helper), and
    a token batch of this DP rank quantized with it and dequantized with every rank's."""
    from vllm.distributed import get_ep_group
    from vllm.model_executor.layers.quantization.utils.fp8_utils import (
        process_fp8_input_tensor_strategy_moe,
    )

    ep = get_ep_group()
    per_rank = NUM_EXPERTS // ep.world_size
    local = slice(ep.rank_in_group * per_rank, (ep.rank_in_group + 1) * per_rank)
    a13, a2 = (s[local].clone() for s in input_scales(spread))
    out = {"ep_rank": ep.rank_in_group}
    for eplb in (False, True):
        g1, _ = process_fp8_input_tensor_strategy_moe(a13.clone(), a2.clone(), eplb)
        out["eplb" if eplb else "no_eplb"] = float(g1)
    gen = torch.Generator().manual_seed(ctx.dp_rank)
    # hidden states whose amax is this rank's collapsed amax: what its scale was calibrated for
    x = torch.randn(TOKENS, HIDDEN, generator=gen)
    out["tokens"] = x * (out["no_eplb"] * E4M3_MAX / x.abs().max())
    return out


def cross_rank_errors(ranks: list[dict], key: str) -> dict:
    """For each (sender, owner) pair: the relative error of the sender's tokens quantized with
    its collapsed scale and dequantized with the owner's (``key``: ``no_eplb`` or ``eplb``)."""
    out = {}
    for s in ranks:
        for o in ranks:
            x = s["tokens"]
            y = _fp8_round_trip(x, torch.tensor(s[key]), torch.tensor(o[key]))
            out[(s["ep_rank"], o["ep_rank"])] = float((y - x).norm() / x.norm())
    return out
