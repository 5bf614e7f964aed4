# SPDX-License-Identifier: Apache-2.0
"""Plain loop-over-experts fp32 oracles for one NVFP4 MoE layer, and random test layers.

Why separate from the emulator: the oracles know nothing about kernel layouts ([w3; w1] order,
swizzled scales, int views, alphas); they dequantize with the checkpoint's own scales. So an
emulator (or plugin) result that matches them is right for the right reason.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .constants import BLOCK_SIZE
from .quantize import dequantize, global_scale, quantize


@dataclass
class QuantizedExperts:
    """One MoE layer in checkpoint semantics (gate/up separate, linear block scales).

    Global scales are in the compressed-tensors sense ``gs = 2688 / amax`` (= 1 / ModelOpt's
    ``weight_scale_2`` / ``input_scale``); gate and up share ``w13_weight_gs`` (joint amax), as
    both ModelOpt and llm-compressor write them (docs/NVFP4-FORMAT.md §1.3, §2).
    """

    w1: torch.Tensor  # uint8 [E, I, H/2]  gate, packed
    w1_sf: torch.Tensor  # float8_e4m3fn [E, I, H/16]
    # up; None for non-gated experts (Nemotron-H's relu2): w1 is then the one GEMM1 projection
    # (the checkpoint's up_proj, which vLLM loads as its only w13 shard)
    w3: Optional[torch.Tensor]  # uint8 [E, I, H/2]
    w3_sf: Optional[torch.Tensor]  # float8_e4m3fn [E, I, H/16]
    w2: torch.Tensor  # uint8 [E, H, I/2]  down
    w2_sf: torch.Tensor  # float8_e4m3fn [E, H, I/16]
    w13_weight_gs: torch.Tensor  # fp32 [E]
    w2_weight_gs: torch.Tensor  # fp32 [E]
    w13_input_gs: torch.Tensor  # fp32 [E]  activation quant scale (CT sense)
    w2_input_gs: torch.Tensor  # fp32 [E]
    # The up half's own weight global scale where the checkpoint gives it one (published GLM
    # exports); None: gate and up share w13_weight_gs.
    w3_weight_gs: Optional[torch.Tensor] = None  # fp32 [E]

    @property
    def gated(self) -> bool:
        """SwiGLU experts (gate and up); False: non-gated relu2 (``relu(x @ w1.T)^2``)."""
        return self.w3 is not None

    @property
    def num_experts(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate(self) -> int:
        return self.w1.shape[1]

    @property
    def device(self) -> torch.device:
        return self.w1.device

    def dequant_w13(self) -> torch.Tensor:
        """fp32 ``[E, 2I, H]`` in checkpoint ``[w1; w3]`` (gate first) order; ``[E, I, H]``
        for non-gated experts."""
        g = self.w13_weight_gs.reshape(-1, 1)
        if not self.gated:
            return dequantize(self.w1, self.w1_sf, g)
        g3 = g if self.w3_weight_gs is None else self.w3_weight_gs.reshape(-1, 1)
        return torch.cat([dequantize(self.w1, self.w1_sf, g), dequantize(self.w3, self.w3_sf, g3)],
                         dim=1)

    def dequant_w2(self) -> torch.Tensor:
        """fp32 ``[E, H, I]``."""
        return dequantize(self.w2, self.w2_sf, self.w2_weight_gs.reshape(-1, 1))

    def experts_slice(self, start: int, stop: int) -> QuantizedExperts:
        """Experts ``[start, stop)`` -- what one EP rank holds."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name)[start:stop] for f in dataclasses.fields(self)
                     if getattr(self, f.name) is not None})

    def intermediate_slice(self, start: int, stop: int) -> QuantizedExperts:
        """Columns ``[start, stop)`` of the intermediate dim -- what one TP rank holds. Bounds
        must be multiples of 16 so whole scale blocks (of w2's K) move with their values."""
        if start % BLOCK_SIZE or stop % BLOCK_SIZE:
            raise ValueError("TP shard bounds must be multiples of 16")
        b0, b1 = start // BLOCK_SIZE, stop // BLOCK_SIZE
        up = {} if not self.gated else dict(w3=self.w3[:, start:stop],
                                            w3_sf=self.w3_sf[:, start:stop])
        return dataclasses.replace(
            self, w1=self.w1[:, start:stop], w1_sf=self.w1_sf[:, start:stop], **up,
            w2=self.w2[..., start // 2:stop // 2], w2_sf=self.w2_sf[..., b0:b1])


def quantize_experts(w1, w3, w2, w13_input_amax, w2_input_amax, *,
                     convention: str = "flashinfer", split_gate_up: bool = False
                     ) -> QuantizedExperts:
    """Quantize master weights ``w1, w3 [E, I, H]``, ``w2 [E, H, I]`` the way the exporters do:
    per-expert global scale from the joint gate/up amax (``split_gate_up``: gate and up each
    from its own, as published GLM exports are), 16-blocks along the input dim. ``w3=None``:
    non-gated experts, ``w1`` the one GEMM1 projection."""
    e = w1.shape[0]
    if w3 is None:
        gs1, gs2 = global_scale(w1.float().abs().reshape(e, -1).amax(1)), \
            global_scale(w2.float().abs().reshape(e, -1).amax(1))
        q1, s1 = quantize(w1, gs1.reshape(-1, 1), convention=convention)
        q2, s2 = quantize(w2, gs2.reshape(-1, 1), convention=convention)
        dev = w1.device
        return QuantizedExperts(
            w1=q1, w1_sf=s1, w3=None, w3_sf=None, w2=q2, w2_sf=s2, w13_weight_gs=gs1,
            w2_weight_gs=gs2,
            w13_input_gs=global_scale(torch.as_tensor(w13_input_amax,
                                                      dtype=torch.float32)).to(dev),
            w2_input_gs=global_scale(torch.as_tensor(w2_input_amax,
                                                     dtype=torch.float32)).to(dev))
    amax1 = w1.float().abs().reshape(e, -1).amax(1)
    amax3 = w3.float().abs().reshape(e, -1).amax(1)
    amax2 = w2.float().abs().reshape(e, -1).amax(1)
    gs13, gs2 = global_scale(torch.maximum(amax1, amax3)), global_scale(amax2)
    gs3 = None
    if split_gate_up:
        gs13, gs3 = global_scale(amax1), global_scale(amax3)
    q1, s1 = quantize(w1, gs13.reshape(-1, 1), convention=convention)
    q3, s3 = quantize(w3, (gs13 if gs3 is None else gs3).reshape(-1, 1), convention=convention)
    q2, s2 = quantize(w2, gs2.reshape(-1, 1), convention=convention)
    dev = w1.device
    return QuantizedExperts(
        w1=q1, w1_sf=s1, w3=q3, w3_sf=s3, w2=q2, w2_sf=s2,
        w13_weight_gs=gs13, w2_weight_gs=gs2,
        w13_input_gs=global_scale(torch.as_tensor(w13_input_amax, dtype=torch.float32)).to(dev),
        w2_input_gs=global_scale(torch.as_tensor(w2_input_amax, dtype=torch.float32)).to(dev),
        w3_weight_gs=gs3)


# Smallest calibrated activation amax per layer in random_experts (others: up to x spread).
# Measured on the test inputs (randn rows with 50x outlier blocks): |x| <= ~160 and SwiGLU
# outputs <= ~2e4, so with these floors no expert's own scale saturates a block scale; only a
# wrong (foreign) scale does, which is part of the bug being reproduced.
W13_INPUT_AMAX_BASE = 256.0
W2_INPUT_AMAX_BASE = 32768.0


def _spread_amax(gen, n: int, base: float, spread: float) -> torch.Tensor:
    """n values log-uniform in [base, base*spread] with min and max hit exactly."""
    if n == 1 or spread == 1.0:
        return torch.full((n,), base, dtype=torch.float32)
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    t = (u - u.min()) / (u.max() - u.min())
    vals = (base * torch.exp(t * math.log(spread))).float()
    lo, hi = int(torch.argmin(t)), int(torch.argmax(t))
    vals[lo], vals[hi] = base, base * spread  # exact in fp32 for our bases and spreads
    return vals


def random_master(shape, *, gen, outliers: bool = True, std: float = 0.1,
                  outlier_factor: float = 8.0) -> torch.Tensor:
    """bf16 ``randn * std`` with (optionally) ~0.5 % of 16-blocks scaled by ``outlier_factor``
    and one all-zero block. Generated on CPU from ``gen`` so seeds are device-independent."""
    x = torch.randn(*shape, generator=gen) * std
    if outliers:
        blocks = x.view(-1, BLOCK_SIZE)
        nb = blocks.shape[0]
        idx = torch.randperm(nb, generator=gen)
        n_out = min(max(1, nb // 200), nb - 1)  # never zero the only block
        blocks[idx[1:1 + n_out]] *= outlier_factor
        if nb >= 2:
            blocks[idx[0]] = 0.0
    return x.to(torch.bfloat16)


def random_experts(num_experts: int, hidden: int, intermediate: int, *, seed: int,
                   input_scale_spread: float = 4.0, device="cpu",
                   outliers: bool = True, gate_up_split: float = 0.0,
                   gated: bool = True) -> QuantizedExperts:
    """A random NVFP4 layer: bf16 masters ~ randn/10 (+ outlier and zero blocks), quantized with
    the flashinfer convention; per-expert input amax log-uniform with max/min ==
    ``input_scale_spread`` exactly, drawn independently for w13 and w2. ``gate_up_split`` >= 1:
    gate and up quantized each with its own global scale, the up masters of the experts scaled
    by factors log-uniform in [1, gate_up_split] (the GEMM2 input amax scaled alike, as a
    calibration of that layer would see it); 0: one joint scale (what exporters usually write).
    ``gated=False``: non-gated relu2 experts (w1 only; the same draws otherwise, w3's unused)."""
    gen = torch.Generator().manual_seed(seed)
    w1 = random_master((num_experts, intermediate, hidden), gen=gen, outliers=outliers)
    w3 = random_master((num_experts, intermediate, hidden), gen=gen, outliers=outliers)
    w2 = random_master((num_experts, hidden, intermediate), gen=gen, outliers=outliers)
    a13 = _spread_amax(gen, num_experts, W13_INPUT_AMAX_BASE, input_scale_spread)
    a2 = _spread_amax(gen, num_experts, W2_INPUT_AMAX_BASE, input_scale_spread)
    if gate_up_split:
        up = _spread_amax(torch.Generator().manual_seed(seed + 7), num_experts, 1.0,
                          gate_up_split)
        w3 = (w3.float() * up.reshape(-1, 1, 1)).to(w3.dtype)
        a2 = a2 * up
    dev = torch.device(device)
    if not gated:
        if gate_up_split:
            raise ValueError("non-gated experts have no gate/up pair to split")
        return quantize_experts(w1.to(dev), None, w2.to(dev), a13.to(dev), a2.to(dev))
    return quantize_experts(w1.to(dev), w3.to(dev), w2.to(dev), a13.to(dev), a2.to(dev),
                            split_gate_up=bool(gate_up_split))


def _routes(topk_ids: torch.Tensor, e: int):
    return torch.nonzero(topk_ids.long() == e, as_tuple=True)


def _scale_for(gs: torch.Tensor, e: int) -> torch.Tensor:
    return gs[e] if gs.dim() == 1 else gs


def _qdq(x: torch.Tensor, gs: torch.Tensor, convention: str) -> torch.Tensor:
    packed, sf = quantize(x, gs, convention=convention)
    return dequantize(packed, sf, gs)


def _moe_loop(x, experts, topk_weights, topk_ids, act_in, act_mid, round_to):
    w13, w2 = experts.dequant_w13(), experts.dequant_w2()
    inter = experts.intermediate
    out = torch.zeros(x.shape[0], experts.hidden, dtype=torch.float32, device=x.device)
    for e in range(experts.num_experts):
        tok, kk = _routes(topk_ids, e)
        if tok.numel() == 0:
            continue
        h = round_to(act_in(x[tok].float(), e) @ w13[e].t())
        if experts.gated:
            gate, up = h[:, :inter], h[:, inter:]
            a = round_to(torch.nn.functional.silu(gate) * up)
        else:
            a = round_to(torch.relu(h).square())
        y = round_to(act_mid(a, e) @ w2[e].t())
        out.index_add_(0, tok, topk_weights[tok, kk].float().unsqueeze(1) * y)
    return out


def moe_reference_fp32(x, experts: QuantizedExperts, topk_weights, topk_ids) -> torch.Tensor:
    """Dequantized weights, UNquantized fp32 activations: the NVFP4-weights-only answer."""
    ident = lambda t, e: t  # noqa: E731
    return _moe_loop(x, experts, topk_weights, topk_ids, ident, ident, lambda t: t)


def moe_reference_nvfp4(x, experts: QuantizedExperts, topk_weights, topk_ids, *, a1_gs,
                        a2_gs: Optional[torch.Tensor] = None, convention: str = "flashinfer",
                        intermediate_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The ideal NVFP4 answer: each expert's input quantized+dequantized with ``a1_gs`` (1-D
    ``[E]``: per expert; 0-dim/float: one shared scale), GEMM2's input with ``a2_gs`` (default
    ``experts.w2_input_gs``, per expert). ``intermediate_dtype`` (e.g. bf16) rounds the GEMM
    outputs and the activation where the kernel stores them (see fused_moe_emulator.py);
    None keeps everything fp32."""
    a1 = torch.as_tensor(a1_gs, dtype=torch.float32).to(x.device)
    a2 = experts.w2_input_gs if a2_gs is None else torch.as_tensor(a2_gs, dtype=torch.float32)
    a2 = a2.to(x.device)
    if intermediate_dtype is None:
        round_to = lambda t: t  # noqa: E731
    else:
        round_to = lambda t: t.to(intermediate_dtype).float()  # noqa: E731
    act_in = lambda t, e: _qdq(t, _scale_for(a1, e), convention)  # noqa: E731
    act_mid = lambda t, e: _qdq(t, _scale_for(a2, e), convention)  # noqa: E731
    return _moe_loop(x, experts, topk_weights, topk_ids, act_in, act_mid, round_to)
