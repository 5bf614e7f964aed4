"""One planted expert whose activation scale is what real quantizers write for an expert that saw
no calibration token, or a legitimately rare expert's large one (issue 19's measurement).

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

import torch

from vllm_fp4_moe_plugin.checkpoint.expert_tensors import (GEMM1_PROJECTIONS, input_scale_name)
from vllm_fp4_moe_plugin.nvfp4 import QuantizedExperts

GEMMS = ("w13", "w2")
# case -> (compressed-tensors input_global_scale, ModelOpt input_scale) as stored; None: the
# case changes the calibrated layer itself (see :func:`reference_experts`).
LLMCOMPRESSOR_NO_STATS_GATE_UP = 1.57e-29  # llmcompressor 0.14, routed calibration, measured
CASES = {
    # llmcompressor's down_proj value for an expert without statistics; ModelOpt: a zero amax.
    "zero": (0.0, 0.0),
    # llmcompressor's gate/up value; ModelOpt: the same (absurd) amax, 2688 / 1.57e-29 / 2688.
    "tiny": (LLMCOMPRESSOR_NO_STATS_GATE_UP, 1.0 / LLMCOMPRESSOR_NO_STATS_GATE_UP),
    # a legitimately rare expert: calibrated amax 20x the layer's largest; must stay untouched.
    "large": None,
}
LARGE_FACTOR = 20.0


def _input_gs(experts: QuantizedExperts, gemm: str) -> torch.Tensor:
    if gemm not in GEMMS:
        raise ValueError(f"planted gemm {gemm!r} must be one of {GEMMS}")
    return experts.w13_input_gs if gemm == "w13" else experts.w2_input_gs


def planted_expert(experts: QuantizedExperts, gemm: str) -> int:
    """The EP=2 partner of the expert with the largest amax (smallest gs) of ``gemm``."""
    return int(_input_gs(experts, gemm).float().argmin()) ^ 1


def reference_experts(experts: QuantizedExperts, gemm: str, case: str) -> QuantizedExperts:
    """The layer a correct loader computes with (module docstring)."""
    if case not in CASES:
        raise ValueError(f"planted case {case!r} must be one of {tuple(CASES)}")
    gs = _input_gs(experts, gemm).clone()
    e = planted_expert(experts, gemm)
    others = torch.cat([gs[:e], gs[e + 1:]])
    # gs = 2688 / amax: the calibrated max amax is the smallest gs; LARGE_FACTOR x it, / 20.
    gs[e] = others.min() / (LARGE_FACTOR if case == "large" else 1.0)
    field = "w13_input_gs" if gemm == "w13" else "w2_input_gs"
    return dataclasses.replace(experts, **{field: gs})


def overrides(experts: QuantizedExperts, fmt: str, prefix: str, gemm: str,
              case: str) -> dict[str, torch.Tensor]:
    """Checkpoint tensors that plant the stored uncalibrated value (empty for ``large``)."""
    stored = CASES[case]
    if stored is None:
        return {}
    value = stored[0] if fmt == "compressed-tensors" else stored[1]
    shape = (1,) if fmt == "compressed-tensors" else ()
    e = planted_expert(experts, gemm)
    projs = GEMM1_PROJECTIONS if gemm == "w13" else ("down_proj",)
    return {input_scale_name(fmt, prefix, e, proj): torch.full(shape, value, dtype=torch.float32)
            for proj in projs}
