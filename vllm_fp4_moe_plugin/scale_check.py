"""The one rule every NVFP4 global scale of a checkpoint must satisfy, in one place.

Used by the plugin at load time (:func:`vllm_fp4_moe_plugin.scales.check_positive_finite`, on
the layer's tensors) and by ``audit`` / ``doctor`` (on the checkpoint's tensors), so a file the
plugin refuses at load is a bad checkpoint in the CLI too, with the same words. Pure Python: no
torch or numpy import, so ``audit`` stays fast.

A global scale (ModelOpt ``input_scale`` / ``weight_scale_2``, compressed-tensors
``input_global_scale`` / ``weight_global_scale``) is bad when it is not floating point (an
int32 or bool tensor would be silently converted by vLLM's loader), does not have the expected
number of elements, or holds a NaN, inf, zero or negative value: each poisons every token routed
through that expert.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

_FLOAT_NAMES = ("float", "bfloat", "half", "double", "f8", "f16", "bf16", "f32", "f64")


class InvalidScaleError(ValueError):
    """A checkpoint scale that would silently poison every token routed through it."""


@functools.lru_cache(maxsize=64)
def is_float_dtype(dtype: str) -> bool:
    """``dtype`` as torch (``torch.float32``), numpy (``float32``) or safetensors (``F32``)
    spell it."""
    name = str(dtype).lower().rsplit(".", 1)[-1]
    return name.startswith(_FLOAT_NAMES)


def _kind(value: float) -> str:
    if value != value:
        return "NaN"
    if math.isinf(value):
        return "inf"
    return "zero" if value == 0 else "negative"


def check_scale(values: Sequence[float], *, where: str, name: str, dtype: Optional[str] = None,
                shape: Optional[Sequence[int]] = None, expect_numel: Optional[int] = None,
                per_expert: int = 0, index_note: str = "") -> None:
    """Raise :class:`InvalidScaleError` naming ``where`` (layer or file) and ``name`` (tensor).

    ``values``: the tensor's elements, flattened. ``per_expert``: elements per expert when the
    tensor stacks experts (its first dimension), so the message names the expert; 0 for a
    per-expert checkpoint tensor (one expert, nothing to index). ``index_note`` qualifies that
    index (e.g. local to an EP rank).
    """
    if dtype is not None and not is_float_dtype(dtype):
        raise InvalidScaleError(
            f"{where}: checkpoint scale {name!r} has dtype {dtype}; NVFP4 global scales are "
            "floating point (float32 as exported) -- re-export this tensor as float32")
    if expect_numel is not None and len(values) != expect_numel:
        shown = list(shape) if shape is not None else f"{len(values)} elements"
        raise InvalidScaleError(
            f"{where}: checkpoint scale {name!r} has shape {shown} ({len(values)} elements); "
            f"expected {expect_numel} element(s): NVFP4 per-tensor global scales are scalars "
            "(shape [] or [1]) -- re-export this tensor")
    bad = [i for i, v in enumerate(values) if not (math.isfinite(v) and v > 0)]
    if not bad:
        return
    value = float(values[bad[0]])
    at = f" at expert index {bad[0] // per_expert}{index_note}" if per_expert else ""
    raise InvalidScaleError(
        f"{where}: checkpoint scale {name!r} is {_kind(value)} ({value!r}){at} "
        f"[{len(bad)} of {len(values)} entries are bad]. NVFP4 global scales must be finite "
        "and > 0; re-export or repair this tensor in the checkpoint.")
