# SPDX-License-Identifier: Apache-2.0
"""Spawn the NVFP4-oracle world's rank groups once each and collect what its rows need.

One DP=2+EP group (``dp_ep_allgather``: vLLM's default dispatch, which quantizes on the sender)
does accuracy (item 4), per-forward work and host time (items 2, 3) and the 2-rank load cost
(item 6); a single-GPU rank repeats items 2 and 3 without cross-rank traffic (a tighter noise
floor); DP=4+EP and DP=8+EP groups do only the load cost. Starting vLLM is most of a rank's
time, so nothing is spawned twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.layout_runs import R1_EXPERTS, R1_MOE_LAYERS
from fp4_moe_lab.simulation.ep_slice import EpSliceScenario
from fp4_moe_lab.simulation.layouts import LAYOUTS, Scenario, spawn
from vllm_fp4_moe_plugin.base.support import Layout

JOB = "benchmarks.oracle_jobs:world_job"
DP_EP = "dp_ep_allgather"


@dataclass(frozen=True)
class OracleSizes:
    slice_ratios: tuple = (1.25, 2.0, 4.0)
    tokens: int = 64
    apply_tokens: tuple = (1, 16, 256)
    apply_calls: int = 1000
    count_tokens: int = 16  # the token count whose forwards are counted (apply_calls of them)
    load_ranks: tuple = (2, 4, 8)
    pwal_layers: int = 3  # real layers timed per mode for PWAL (after one untimed)
    # the PWAL layer: DeepSeek-R1's 256 experts and top-8, small H/I (a CPU box holds 256
    # experts at full size only barely, once per rank)
    pwal_shape: dict = field(default_factory=lambda: {"num_experts": R1_EXPERTS, "hidden": 256,
                                                      "intermediate": 512})
    single_rank: bool = True  # also time/count forwards on a single rank (no gloo traffic)


def smoke_sizes() -> OracleSizes:
    """One DP=2+EP spawn does everything (starting vLLM ranks is most of the smoke's time)."""
    return OracleSizes(slice_ratios=(2.0,), tokens=32, apply_tokens=(16,), apply_calls=100,
                       load_ranks=(2,), pwal_layers=1,
                       pwal_shape={"num_experts": 16, "hidden": 256, "intermediate": 512},
                       single_rank=False)


def pwal_experts(sizes: OracleSizes):
    from fp4_moe_lab.nvfp4 import random_experts

    s = sizes.pwal_shape
    return random_experts(s["num_experts"], s["hidden"], s["intermediate"], seed=3)


def run_all(sizes: OracleSizes, items) -> dict:
    """``{"single": [rank result], "dp2": [rank results], "dp4": ..., "dp8": ...}`` (what
    ``items`` need)."""
    experts = pwal_experts(sizes) if 6 in items and sizes.pwal_layers else None
    load = {"num_layers": R1_MOE_LAYERS, "num_experts": R1_EXPERTS, "experts": experts,
            "pwal_layers": sizes.pwal_layers}
    spec: dict = {}
    if 4 in items:
        spec["accuracy"] = {"scenarios": [EpSliceScenario(tokens=sizes.tokens, slice_ratio=r)
                                          for r in sizes.slice_ratios]}
    if 2 in items or 3 in items:
        spec["forward"] = {"scenario": Scenario(tokens=sizes.tokens),
                           "token_counts": sizes.apply_tokens, "calls": sizes.apply_calls,
                           "count_tokens": sizes.count_tokens}
    if 6 in items and 2 in sizes.load_ranks:
        spec["load"] = load
    out: dict = {}
    if "forward" in spec and sizes.single_rank:  # the same without any cross-rank traffic
        out["single"] = spawn(LAYOUTS["single"], JOB, {"forward": spec["forward"]})
    if spec:
        out["dp2"] = spawn(LAYOUTS[DP_EP], JOB, spec, timeout_s=1800)
    if 6 in items:
        for n in sizes.load_ranks:
            if n != 2:
                out[f"dp{n}"] = spawn(Layout.deployed(dp=n, ep=True), JOB, {"load": load},
                                      timeout_s=1800)
    return out
