# SPDX-License-Identifier: Apache-2.0
"""Shared builders for the MoE emulator tests: a random layer, inputs with outliers, routing."""

import dataclasses
from dataclasses import dataclass

import torch

from fp4_moe_lab import nvfp4

INPUT_STD = 1.0
INPUT_OUTLIER_FACTOR = 50.0  # a few 16-blocks of every input are 50x larger; one is all zero


@dataclass
class MoeCase:
    experts: nvfp4.QuantizedExperts
    x: torch.Tensor  # bf16 [M, H]
    topk_weights: torch.Tensor  # fp32 [M, top_k]
    topk_ids: torch.Tensor  # int32 [M, top_k], global expert ids


def make_case(num_experts, hidden, inter, m, *, seed, device, top_k=2, spread=4.0) -> MoeCase:
    experts = nvfp4.random_experts(num_experts, hidden, inter, seed=seed,
                                   input_scale_spread=spread, device=device)
    gen = torch.Generator().manual_seed(1000 + seed)
    x = nvfp4.random_master((m, hidden), gen=gen, std=INPUT_STD,
                            outlier_factor=INPUT_OUTLIER_FACTOR)
    logits = torch.randn(m, num_experts, generator=gen)
    weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    return MoeCase(experts, x.to(device), weights.float().to(device), ids.int().to(device))


def with_first_expert_extreme(experts, *, largest: bool):
    """Swap w13 input scales so expert 0 has the largest (or smallest) one -- the expert whose
    scale the stock path applies to every expert."""
    gs = experts.w13_input_gs.clone()
    i = int(gs.argmax() if largest else gs.argmin())
    gs[0], gs[i] = experts.w13_input_gs[i], experts.w13_input_gs[0]
    return dataclasses.replace(experts, w13_input_gs=gs)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in fp32."""
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm())
