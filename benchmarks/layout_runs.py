# SPDX-License-Identifier: Apache-2.0
"""Spawn each layout once (``simulation.layouts.spawn``) and collect what items 2, 3, 4, 6 need.

Why one spawn per layout: a rank's cost is mostly starting vLLM, so ``benchmarks.jobs.
layout_job`` does all of a layout's work in one go. Item 2 rides on the single-GPU layout and
item 6 (2 ranks) on ``dp_ep_allgather``; item 6 at 4 ranks gets its own DP=4+EP group.
"""

from __future__ import annotations

from dataclasses import dataclass

from fp4_moe_lab.simulation.layouts import LAYOUT_NAMES, LAYOUTS, Layout, Scenario, spawn

JOB = "benchmarks.jobs:layout_job"
R1_MOE_LAYERS = 58  # DeepSeek-R1: layers 3..60 are MoE (first_k_dense_replace=3)
R1_EXPERTS = 256


@dataclass(frozen=True)
class Sizes:
    scenario: Scenario
    spreads: tuple = (1.5, 4.0)
    layouts: tuple = LAYOUT_NAMES  # the eight of vLLM 0.11.0 (LAYOUTS adds the oracle-only one)
    apply_tokens: tuple = (1, 16, 256, 4096)
    apply_calls: int = 200
    load_ranks: tuple = (2, 4)


def run_all(sizes: Sizes) -> dict:
    """``{layout: [rank results]}`` plus ``"load4"`` (a DP=4 group) when asked."""
    out: dict = {}
    load = {"num_layers": R1_MOE_LAYERS, "num_experts": R1_EXPERTS}
    for name in sizes.layouts:
        spec: dict = {"schemes": {"scenario": sizes.scenario, "spreads": sizes.spreads,
                                  "token_scales": (1.0,)}}
        if name == "single":
            spec["apply"] = {"scenario": sizes.scenario, "token_counts": sizes.apply_tokens,
                             "calls": sizes.apply_calls}
        if name == "dp_ep_allgather" and 2 in sizes.load_ranks:
            spec["load"] = load
        out[name] = spawn(LAYOUTS[name], JOB, spec)
    for n in sizes.load_ranks:
        if n != 2:
            out[f"load{n}"] = spawn(Layout(f"dp{n}_ep", dp=n, ep=True), JOB, {"load": load})
    return out
