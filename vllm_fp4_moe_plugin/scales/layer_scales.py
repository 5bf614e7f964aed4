# SPDX-License-Identifier: Apache-2.0
"""A loaded NVFP4 MoE layer's global scales, as the checkpoint gave them: weight scales checked by
``scale_rule`` (refused, naming layer, tensor and expert), uncalibrated or missing experts'
activation scales repaired with the calibrated experts' max amax (strict mode refuses), before
vLLM inverts them and before any collapse or agreement carries them further. vLLM is imported
only to find the EP group of a layer whose experts its ranks split (:func:`ep_cpu_group`)."""

from __future__ import annotations

import math

import torch

from vllm_fp4_moe_plugin.base import envs
from vllm_fp4_moe_plugin.base.log import get_logger, layer_label, local_experts_note
from vllm_fp4_moe_plugin.scales import scale_agreement, unloaded
from vllm_fp4_moe_plugin.scales.scale_rule import (
    InvalidScaleError,
    check_scale,
    check_spread,
    judge,
)

logger = get_logger("layer_scales")

# The raw tensors as each format's quant method registers them on the layer, in every design
# (v0.34.0 CT w4a4_nvfp4.py:180-210; Q/modelopt.py:1020-1060).
RAW_SCALES = {
    "modelopt": {"input": ("w13_input_scale", "w2_input_scale"),
                 "weight": ("w13_weight_scale_2", "w2_weight_scale_2")},
    "compressed-tensors": {"input": ("w13_input_global_scale", "w2_input_global_scale"),
                           "weight": ("w13_weight_global_scale", "w2_weight_global_scale")},
}


def check_weight_scales(layer, fmt: str) -> None:
    if unloaded.dummy_weights(layer):  # --load-format dummy: no checkpoint to check
        return
    for attr in RAW_SCALES[fmt]["weight"]:
        check_positive_finite(getattr(layer, attr), layer=layer_label(layer), name=attr)


def repair_activation_scales(layer, fmt: str, stock_effect: str = "") -> None:
    """Repair the layer's activation scales in place (a no-op for calibrated checkpoints). Where
    the layer holds only its rank's experts (:func:`holds_local_slice`), the EP group judges the
    whole layer, so every layout loads the same values."""
    if unloaded.dummy_weights(layer):  # --load-format dummy: no checkpoint to repair
        return
    for attr in RAW_SCALES[fmt]["input"]:
        param = getattr(layer, attr)
        check_positive_finite(param, layer=layer_label(layer), name=attr, activation=True)
        group = ep_cpu_group() if holds_local_slice(layer, param) else None
        repaired = repair_uncalibrated(
            param.data, reciprocal=fmt == "compressed-tensors", layer=layer_label(layer),
            name=attr, index_note=local_experts_note(layer), stock_effect=stock_effect,
            missing=tuple(unloaded.missing_rows(param.data)), group=group)
        if repaired is not param.data:
            param.data.copy_(repaired)


def ep_cpu_group():
    """vLLM's EP group (its CPU side), for the load-time agreement: the one vLLM import here."""
    from vllm.distributed import get_ep_group

    return get_ep_group().cpu_group


def holds_local_slice(layer, scales: torch.Tensor) -> bool:
    """Under EP, do ``scales`` (one row per expert) hold only this rank's experts? (compressed-
    tensors sizes them to the local experts; ModelOpt loads every expert's, vllm#26135.)"""
    moe_config = getattr(layer, "moe_config", None)
    pc = getattr(moe_config, "moe_parallel_config", None)
    ep_size = int(getattr(layer, "ep_size", None) or getattr(pc, "ep_size", 1) or 1)
    total = int(getattr(layer, "global_num_experts", None)
                or getattr(moe_config, "num_experts", 0) or 0)
    return ep_size > 1 and scales.dim() > 0 and 0 < scales.shape[0] < total


def check_positive_finite(tensor: torch.Tensor, *, layer: str, name: str,
                          index_note: str = "", activation: bool = False) -> None:
    """Raise by ``scale_rule``'s rule, naming the layer, tensor and first bad expert (qualified by
    ``index_note``). ``activation``: dtype only (:func:`repair_uncalibrated` judges values)."""
    t = tensor.detach()
    if not t.is_floating_point() or t.dtype.itemsize == 1:  # float8 scales are refused too
        check_scale([], where=layer, name=name, dtype=str(t.dtype))
    if activation:
        return
    t = t.float()
    bad = ~torch.isfinite(t) | (t <= 0)
    if not bool(bad.any()):  # the common case stays one vectorized pass
        return
    per_expert = max(1, t[0].numel()) if t.dim() else 0
    check_scale(t.reshape(-1).tolist(), where=layer, name=name, per_expert=per_expert,
                index_note=index_note)


class UncalibratedScaleError(InvalidScaleError):
    """``VLLM_FP4_MOE_PLUGIN_CHECK=strict`` and a layer has experts without calibrated scales."""


_uncalibrated_warned = False


def repair_uncalibrated(stored: torch.Tensor, *, reciprocal: bool, layer: str, name: str,
                        index_note: str = "", stock_effect: str = "",
                        missing: tuple[int, ...] | list[int] = (), group=None) -> torch.Tensor:
    """``stored`` (one layer's activation scales, ``[E]`` or ``[E, k]``) unchanged, or a copy
    whose uncalibrated experts (``scale_rule.judge``, or ``missing``) carry the stored value of
    the calibrated expert with the largest amax, as ModelOpt's exporter does. ``reciprocal``:
    inverse to the amax (``input_global_scale``). ``group``: the EP group when ``stored`` is this
    rank's slice; the calibrated range and the fallback are then the whole layer's (one MIN
    all-reduce, on every rank alike). Logs a WARNING at the first such layer per process, then
    INFO; refuses a layer whose calibrated and dead values cannot be told apart, or that has no
    calibrated expert; strict mode refuses any repair."""
    values = stored.detach().float().reshape(stored.shape[0] if stored.dim() else 1, -1)
    with torch.no_grad():
        scales = (1.0 / values) if reciprocal else values  # a stored 0 becomes inf
    flagged, _ = judge([tuple(row) for row in scales.tolist()])
    flagged.update({e: "missing" for e in missing if 0 <= e < values.shape[0]})
    good = [e for e in range(values.shape[0]) if e not in flagged]
    # the calibrated cluster in stored units, exact: (smallest, largest) stored value
    kept = values[good] if good else values.new_empty(0)
    lo, hi = (float(kept.min()), float(kept.max())) if good else (math.inf, -math.inf)
    if group is not None:
        lo, hi = scale_agreement.agree_range(lo, hi, group, layer=layer)
    where = f"{layer}: {name}{index_note}"
    if hi >= lo:  # input scales: the stored values, or their reciprocals
        check_spread(*((1.0 / hi, 1.0 / lo) if reciprocal else (lo, hi)), where=where)
    if not flagged:
        return stored
    bad = sorted(flagged)
    shown = ", ".join(f"{e} (missing from the checkpoint)" if flagged[e] == "missing" else
                      f"{e} ({flagged[e]}: {_values(values[e])})" for e in bad[:8]) + (
        ", ..." if len(bad) > 8 else "")
    where = f"{layer}: {name}: expert(s) {shown}{index_note}"
    if not hi >= lo:
        raise InvalidScaleError(
            f"{where}: no expert of this layer has a calibrated activation scale, so there is "
            "nothing to fall back on; re-quantize the checkpoint with calibration data that "
            "reaches every expert (llmcompressor: moe_calibrate_all_experts=True)")
    fallback = lo if reciprocal else hi
    if envs.VLLM_FP4_MOE_PLUGIN_CHECK == "strict":
        raise UncalibratedScaleError(
            f"{where}: uncalibrated activation scale (the expert saw no calibration token, or "
            f"the checkpoint has no such tensor). {stock_effect}Re-quantize with calibration that "
            "reaches every expert (llmcompressor: moe_calibrate_all_experts=True, its default), "
            "or set VLLM_FP4_MOE_PLUGIN_CHECK=warn to serve with the calibrated experts' max amax "
            "for them.")
    global _uncalibrated_warned
    log = logger.info if _uncalibrated_warned else logger.warning
    _uncalibrated_warned = True
    log("vllm-fp4-moe-plugin: %s: uncalibrated activation scale (no calibration token reached "
        "the expert, or the checkpoint has no such tensor); loading the calibrated experts' "
        "max amax instead (value %.6g), as ModelOpt's exporter does. %sRe-quantize with "
        "all-experts calibration to remove this.", where, fallback, stock_effect)
    out = stored.detach().clone()
    rows = torch.tensor(bad, dtype=torch.long, device=stored.device)
    out.reshape(values.shape)[rows] = torch.tensor(fallback, dtype=out.dtype, device=out.device)
    return out


def _values(row: torch.Tensor) -> str:
    return "/".join(f"{float(v):.3g}" for v in row)


def _reset_for_tests() -> None:
    global _uncalibrated_warned
    _uncalibrated_warned = False
