"""The one rule every NVFP4 global scale of a checkpoint must satisfy, in one place.

Used by the plugin at load time (:func:`vllm_fp4_moe_plugin.scales.check_positive_finite`, on
the layer's tensors) and by ``audit`` / ``doctor`` (on the checkpoint's tensors), so a file the
plugin refuses at load is a bad checkpoint in the CLI too, with the same words. Pure Python: no
torch or numpy import, so ``audit`` stays fast.

A global scale (ModelOpt ``input_scale`` / ``weight_scale_2``, compressed-tensors
``input_global_scale`` / ``weight_global_scale``) is bad when it is not floating point (an
int32 or bool tensor would be silently converted by vLLM's loader), does not have the expected
number of elements, or holds a NaN, inf, zero or negative value: each poisons every token routed
through that expert. One exception, the *uncalibrated* activation scale: a quantizer writes 0 (or
a value implying an absurd amax) for an expert that saw no calibration token. That is a known
calibration outcome, not corruption, and :func:`uncalibrated_experts` says which experts carry
one; the plugin replaces it at load by the calibrated experts' max amax, as NVIDIA's ModelOpt
exporter does when it writes such experts (docs/NVFP4-FORMAT.md §6).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

# The dtypes a global scale may be stored in: every exporter writes float32; 16- and 64-bit floats
# convert exactly enough. 8-bit floats do not: E4M3's largest value is 448, below typical
# compressed-tensors global scales, and 3 mantissa bits would move every scale by up to 6 %.
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
                per_expert: int = 0, index_note: str = "", zero_ok: bool = False) -> None:
    """Raise :class:`InvalidScaleError` naming ``where`` (layer or file) and ``name`` (tensor).

    ``values``: the tensor's elements, flattened. ``per_expert``: elements per expert when the
    tensor stacks experts (its first dimension), so the message names the expert; 0 for a
    per-expert checkpoint tensor (one expert, nothing to index). ``index_note`` qualifies that
    index (e.g. local to an EP rank). ``zero_ok``: an activation (input) scale, where 0 means
    "no calibration statistics" and is judged by :func:`uncalibrated_experts` instead.
    """
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
    bad = [i for i, v in enumerate(values)
           if not (math.isfinite(v) and (v > 0 or (zero_ok and v == 0)))]
    if not bad:
        return
    value = float(values[bad[0]])
    at = f" at expert index {bad[0] // per_expert}{index_note}" if per_expert else ""
    raise InvalidScaleError(
        f"{where}: checkpoint scale {name!r} is {_kind(value)} ({value!r}){at} "
        f"[{len(bad)} of {len(values)} entries are bad]. NVFP4 global scales must be finite "
        f"and {'>= 0' if zero_ok else '> 0'}; re-export or repair this tensor in the checkpoint.")


# --- uncalibrated activation scales ----------------------------------------------------------
# E4M3, the format of NVFP4's per-block scales: largest finite value and smallest normal.
E4M3_MAX = 448.0
E4M3_MIN_NORMAL = 2.0 ** -6
# How far above the layer's reference input amax an expert's amax may lie before no calibration
# of this layer can have produced it: E4M3's normal range, 448 / 2**-6 = 28672 (2**14.8). Shared
# as one scale (vLLM 0.14+ collapses each rank's experts to their max; every DP dispatch shares
# one scale over the EP group), an amax that much larger makes even the largest block scale of
# the reference expert's activations subnormal in E4M3, and 16x further flushes them to zero:
# the layer would compute nothing. Real spreads are orders of magnitude smaller (measured on
# llmcompressor checkpoints: 1.0-1.5x for gate/up, 5-17x for down_proj; docs/NVFP4-FORMAT.md §6).
UNCALIBRATED_MARGIN = E4M3_MAX / E4M3_MIN_NORMAL


def uncalibrated_experts(amax: Sequence[float]) -> list[int]:
    """The experts whose activation scale no calibration of this layer could have produced.

    ``amax``: one value per expert proportional to its input amax (ModelOpt's ``input_scale``,
    or ``1 / input_global_scale`` of compressed-tensors, where a stored 0 becomes inf), already
    checked by :func:`check_scale` (no NaN or negative). An expert is uncalibrated when its
    amax is 0 (no statistics), inf (a zero compressed-tensors global scale), or more than
    :data:`UNCALIBRATED_MARGIN` times the layer's reference amax: the lower median of the
    finite positive ones, which a minority of absurd values cannot move. Small amaxes are never
    flagged: a max-collapse ignores them, and they saturate only their own expert's tokens.
    """
    usable = sorted(a for a in amax if 0 < a < math.inf)
    if not usable:
        return list(range(len(amax)))
    reference = usable[(len(usable) - 1) // 2]
    return [i for i, a in enumerate(amax)
            if not 0 < a < math.inf or a > reference * UNCALIBRATED_MARGIN]


def uncalibrated_kind(amax: float) -> str:
    """How an uncalibrated expert's amax looks, for messages."""
    if amax == 0:
        return "zero amax"
    if math.isinf(amax):
        return "infinite amax"
    return "absurd amax"
