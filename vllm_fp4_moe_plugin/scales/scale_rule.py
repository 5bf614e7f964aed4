# SPDX-License-Identifier: Apache-2.0
"""The one rule every NVFP4 global scale of a checkpoint must satisfy, in one place.

Shared by the plugin at load (:func:`.layer_scales.check_positive_finite`) and ``audit`` /
``doctor``, so a file the plugin refuses is a bad checkpoint in the CLI too, in the same
words; pure Python, so ``audit`` stays fast. A global scale is bad when not floating point (vLLM's
loader converts int32 or bool silently), of the wrong size, or NaN, inf, zero or negative: each
poisons every token routed through that expert. Activation scales are judged by
:func:`uncalibrated`: the value of an expert no calibration token reached is a known outcome, not
corruption, which the plugin replaces by the calibrated experts' max amax (NVFP4-FORMAT §6);
a value a calibration can have produced is never replaced, and a layer whose plausible values
cannot all be calibrated is refused (:class:`IndistinguishableScalesError`), not guessed."""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

from vllm_fp4_moe_plugin.scales.nvfp4_constants import E4M3_MAX, FP4_MAX

# Every exporter writes float32; 16- and 64-bit floats convert exactly enough. 8-bit floats do not:
# E4M3's max, 448, is below typical compressed-tensors global scales; 3 mantissa bits: up to 6 %.
ALLOWED_DTYPES = ("float32", "bfloat16", "float16", "float64")
_ALIASES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
            "float": "float32", "half": "float16", "double": "float64"}


class InvalidScaleError(ValueError):
    """A checkpoint scale that would silently poison every token routed through it."""


@functools.lru_cache(maxsize=64)
def is_float_dtype(dtype: str) -> bool:
    """``dtype`` as torch (``torch.float32``), numpy (``float32``) or safetensors (``F32``)
    spell it is one of :data:`ALLOWED_DTYPES`."""
    name = str(dtype).lower().rsplit(".", 1)[-1]
    return _ALIASES.get(name, name) in ALLOWED_DTYPES


def _kind(value: float) -> str:
    if value != value:
        return "NaN"
    if math.isinf(value):
        return "inf"
    return "zero" if value == 0 else "negative"


def check_scale(values: Sequence[float], *, where: str, name: str, dtype: Optional[str] = None,
                shape: Optional[Sequence[int]] = None, expect_numel: Optional[int] = None,
                per_expert: int = 0, index_note: str = "", activation: bool = False) -> None:
    """Raise :class:`InvalidScaleError` naming ``where`` (layer or file) and ``name`` (tensor).
    ``per_expert``: elements per expert of a stacked tensor, to name the expert (0: one expert;
    ``index_note`` qualifies it). ``activation``: an input scale: dtype and shape only."""
    if dtype is not None and not is_float_dtype(dtype):
        raise InvalidScaleError(
            f"{where}: checkpoint scale {name!r} has dtype {dtype}; NVFP4 global scales must be "
            f"one of {', '.join(ALLOWED_DTYPES)} (exporters write float32) -- re-export this "
            "tensor as float32")
    if expect_numel is not None and len(values) != expect_numel:
        shown = list(shape) if shape is not None else f"{len(values)} elements"
        raise InvalidScaleError(
            f"{where}: checkpoint scale {name!r} has shape {shown} ({len(values)} elements); "
            f"expected {expect_numel} element(s): NVFP4 per-tensor global scales are scalars "
            "(shape [] or [1]) -- re-export this tensor")
    if activation:
        return
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v > 0)]
    if not bad:
        return
    value = float(values[bad[0]])
    at = f" at expert index {bad[0] // per_expert}{index_note}" if per_expert else ""
    raise InvalidScaleError(
        f"{where}: checkpoint scale {name!r} is {_kind(value)} ({value!r}){at} "
        f"[{len(bad)} of {len(values)} entries are bad]. NVFP4 global scales must be finite "
        "and > 0; re-export or repair this tensor in the checkpoint.")


# --- uncalibrated activation scales ----------------------------------------------------------
E4M3_MIN_NORMAL = 2.0 ** -6  # smallest normal of E4M3 (NVFP4's block-scale format)
# The widest spread one layer's calibrated experts may show, either way: E4M3's normal range,
# 448 / 2**-6 = 28672 (2**14.8). Shared as one scale (0.14+ takes each rank's max; DP dispatch
# shares one over the EP group), an amax that much larger makes the others' largest block scale
# subnormal (16x further: zero, the layer computes nothing); per expert (0.11.x), one that much
# smaller saturates every block. Real spreads are far smaller (llmcompressor: 1.0-1.5x gate/up,
# 5-17x down_proj; NVFP4-FORMAT §6).
UNCALIBRATED_MARGIN = E4M3_MAX / E4M3_MIN_NORMAL
# Where a calibrated activation amax of an NVFP4 MoE expert can lie at all, in amax units: the
# inputs of a MoE layer are a BF16 model's normalized hidden states (GEMM1) and act(gate) * up
# (GEMM2), measured from ~0.01 to ~1e4 in the field. What quantizers write for an expert without
# statistics lies decades outside (amax 1e-29, 1e-20, 2e-24, 1e22, 2e32, 2e41; NVFP4-FORMAT §6).
AMAX_MIN, AMAX_MAX = 2.0 ** -16, 2.0 ** 32
# The values the rule is handed are input scales: amax / (448 * 6) (ModelOpt's input_scale,
# 1 / compressed-tensors' input_global_scale, vLLM's a13_scale / a2_scale).
AMAX_PER_INPUT_SCALE = E4M3_MAX * FP4_MAX


class IndistinguishableScalesError(InvalidScaleError):
    """A layer whose plausible activation scales lie too far apart for all to be calibrated,
    where no rule can tell which are: refused rather than guessed."""


def plausible(input_scale: float) -> bool:
    """Could a calibration have produced this input scale (amax / 2688)?"""
    return AMAX_MIN <= input_scale * AMAX_PER_INPUT_SCALE <= AMAX_MAX


def judge(input_scales: Sequence) -> tuple[dict[int, str], list[float]]:
    """The experts no calibration can have produced, by kind (``"high"``: NaN, inf or above
    :data:`AMAX_MAX`, which a max over experts takes; ``"low"``: 0, negative or below
    :data:`AMAX_MIN`, which a max ignores), and every other value (the calibrated cluster).
    ``input_scales``: per expert, a value or tuple (gate, up). Each value is judged alone, so
    the verdict does not depend on which experts a rank holds, nor on how many are dead."""
    flags: dict[int, str] = {}
    kept: list[float] = []
    for i, a in enumerate(input_scales):
        vs = tuple(a) if isinstance(a, (tuple, list)) else (a,)
        if any(v != v or v * AMAX_PER_INPUT_SCALE > AMAX_MAX for v in vs):  # NaN, inf, above
            flags[i] = "high"
        elif any(not v * AMAX_PER_INPUT_SCALE >= AMAX_MIN for v in vs):  # 0, negative, below
            flags[i] = "low"
        else:
            kept.extend(vs)
    return flags, kept


def check_spread(lo: float, hi: float, *, where: str = "") -> None:
    """Refuse a calibrated cluster (its smallest and largest input scale, over the whole layer)
    wider than :data:`UNCALIBRATED_MARGIN`: some of its values are not calibrated, and nothing
    says which."""
    if lo > 0 and hi / lo > UNCALIBRATED_MARGIN:
        amax = AMAX_PER_INPUT_SCALE
        raise IndistinguishableScalesError(
            f"{where + ': ' if where else ''}activation amaxes from {lo * amax:.4g} to "
            f"{hi * amax:.4g} ({hi / lo:.3g}x apart, more than the {UNCALIBRATED_MARGIN:g}x one "
            "layer's calibrated experts can span): some are not calibrated, and calibrated and "
            "dead values cannot be told apart here. Re-quantize with calibration that reaches "
            "every expert (llmcompressor: moe_calibrate_all_experts=True), or correct these "
            "tensors in the checkpoint.")


def uncalibrated(input_scales: Sequence, *, where: str = "") -> dict[int, str]:
    """:func:`judge`'s verdict for a whole layer (one GEMM input), after :func:`check_spread`
    on what it kept."""
    flags, kept = judge(input_scales)
    if kept:
        check_spread(min(kept), max(kept), where=where)
    return flags


def uncalibrated_experts(input_scales: Sequence) -> list[int]:
    """The indices of :func:`uncalibrated`, in order."""
    return sorted(uncalibrated(input_scales))
