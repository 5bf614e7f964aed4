# SPDX-License-Identifier: Apache-2.0
"""The accuracy fixture of the 0.34.0 world: two EP slices whose GEMM1 local maxima differ by an
exact ratio.

Why its own fixture: on the NVFP4-oracle design the stock compressed-tensors error under DP+EP
is set by how far the EP ranks' *local* maxima of the GEMM1 input amax are apart (each rank
collapses to its own, ``support.rank_local_maxima``), not by the spread over all experts. The
rows want that ratio to be exactly 1.25x, 2x and 4x. Weights and tokens are the project's
``Scenario`` (same seeds); only the input amax are planted:

* GEMM1: EP slice 0 (experts ``0..E/2-1`` under vLLM's linear placement, EP=2) log-uniform in
  ``[BASE, BASE*WITHIN]``, both ends hit; slice 1 is the same pattern times ``ratio``. So the
  maxima are ``BASE*WITHIN`` and ``BASE*WITHIN*ratio``: exact in fp32 for these values.
* GEMM2: both slices in ``[W2_BASE, W2_BASE*WITHIN]`` with the same max, so the per-rank GEMM2
  collapse (compressed-tensors) and the all-expert one (ModelOpt) are the same value and the
  only scheme difference left is GEMM1's scale -- the one the plugin agrees.
Every amax is >= the project's floors (``nvfp4.reference.W13_INPUT_AMAX_BASE`` ...), under which
no expert's own scale saturates on these tokens.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fp4_moe_lab.simulation.layouts import Scenario

WITHIN = 1.5  # max/min of the input amax inside one EP slice
EP_SIZE = 2


def _slice_pattern(gen: torch.Generator, n: int, base: float) -> torch.Tensor:
    """n values log-uniform in [base, base*WITHIN], min and max hit exactly."""
    u = torch.rand(n, generator=gen, dtype=torch.float64)
    t = (u - u.min()) / (u.max() - u.min())
    vals = (base * torch.exp(t * math.log(WITHIN))).float()
    vals[int(torch.argmin(t))], vals[int(torch.argmax(t))] = base, base * WITHIN
    return vals


def planted_amax(num_experts: int, ratio: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(GEMM1 input amax, GEMM2 input amax) per expert, as described in the module docstring."""
    from fp4_moe_lab.nvfp4.reference import W2_INPUT_AMAX_BASE, W13_INPUT_AMAX_BASE

    if num_experts % EP_SIZE or num_experts // EP_SIZE < 2:
        raise ValueError(f"need an even number of experts >= 4, not {num_experts}")
    half = num_experts // EP_SIZE
    gen = torch.Generator().manual_seed(seed + 7919)
    a13 = _slice_pattern(gen, half, W13_INPUT_AMAX_BASE)
    a13 = torch.cat([a13, a13 * ratio])
    a2 = torch.cat([_slice_pattern(gen, half, W2_INPUT_AMAX_BASE),
                    _slice_pattern(gen, half, W2_INPUT_AMAX_BASE)])
    return a13, a2


@dataclasses.dataclass(frozen=True)
class EpSliceScenario(Scenario):
    """``Scenario`` whose experts carry :func:`planted_amax` (picklable: spawned ranks rebuild
    it from the seeds, like every other scenario)."""

    slice_ratio: float = 2.0

    def experts(self):
        from fp4_moe_lab.nvfp4 import global_scale

        base = super().experts()
        a13, a2 = planted_amax(self.num_experts, self.slice_ratio, self.seed)
        return dataclasses.replace(base, w13_input_gs=global_scale(a13),
                                   w2_input_gs=global_scale(a2))


def slice_maxima_ratio(scenario: EpSliceScenario) -> float:
    """The ratio the ranks see: the larger over the smaller EP rank's local max of the planted
    GEMM1 input amax, sliced by the support model (vLLM's linear placement)."""
    from vllm_fp4_moe_plugin.base import support

    amax = planted_amax(scenario.num_experts, scenario.slice_ratio, scenario.seed)[0].tolist()
    lo, hi = sorted(support.rank_local_maxima(amax, EP_SIZE))
    return hi / lo
