# SPDX-License-Identifier: Apache-2.0
"""A loaded NVFP4 MoE layer's global scales, as the checkpoint gave them: weight scales checked by
``scale_rule`` (refused, naming layer, tensor and expert), uncalibrated or missing experts'
activation scales repaired with the calibrated experts' max amax (strict mode refuses), before
vLLM inverts them and before any collapse or agreement carries them further. No vLLM import."""

from __future__ import annotations

import torch

from vllm_fp4_moe_plugin import envs, unloaded
from vllm_fp4_moe_plugin.log import get_logger, layer_label, local_experts_note
from vllm_fp4_moe_plugin.scale_rule import InvalidScaleError, check_scale, uncalibrated

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
    for attr in RAW_SCALES[fmt]["weight"]:
        check_positive_finite(getattr(layer, attr), layer=layer_label(layer), name=attr)


def repair_activation_scales(layer, fmt: str, stock_effect: str = "") -> None:
    """Repair the layer's activation scales in place (a no-op for calibrated checkpoints)."""
    for attr in RAW_SCALES[fmt]["input"]:
        param = getattr(layer, attr)
        check_positive_finite(param, layer=layer_label(layer), name=attr, activation=True)
        repaired = repair_uncalibrated(
            param.data, reciprocal=fmt == "compressed-tensors", layer=layer_label(layer),
            name=attr, index_note=local_experts_note(layer), stock_effect=stock_effect,
            missing=tuple(unloaded.missing_rows(param.data)))
        if repaired is not param.data:
            param.data.copy_(repaired)


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
                        missing: tuple[int, ...] | list[int] = ()) -> torch.Tensor:
    """``stored`` (one layer's activation scales, ``[E]`` or ``[E, k]``) unchanged, or a copy
    whose uncalibrated experts carry the value of the calibrated expert with the largest amax, as
    ModelOpt's exporter does. ``reciprocal``: inverse to the amax (``input_global_scale``). Logs a
    WARNING at the first such layer per process, then INFO; strict mode raises."""
    values = stored.detach().float().reshape(stored.shape[0] if stored.dim() else 1, -1)
    with torch.no_grad():
        amax = (1.0 / values) if reciprocal else values  # a stored 0 becomes inf
    flagged = uncalibrated([tuple(row) for row in amax.tolist()])
    flagged.update({e: "missing" for e in missing if 0 <= e < values.shape[0]})
    if not flagged:
        return stored
    bad = sorted(flagged)
    good = [e for e in range(values.shape[0]) if e not in flagged]
    shown = ", ".join(f"{e} (missing from the checkpoint)" if flagged[e] == "missing" else
                      f"{e} ({flagged[e]}: {_values(values[e])})" for e in bad[:8]) + (
        ", ..." if len(bad) > 8 else "")
    where = f"{layer}: {name}: expert(s) {shown}{index_note}"
    if not good:
        raise InvalidScaleError(
            f"{where}: no expert of this layer{index_note and ' on this rank'} has a calibrated "
            "activation scale, so there is nothing to fall back on; re-quantize the checkpoint "
            "with calibration data that reaches every expert (llmcompressor: "
            "moe_calibrate_all_experts=True)")
    kept = values[good]
    fallback = kept.min() if reciprocal else kept.max()
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
        "all-experts calibration to remove this.", where, float(fallback), stock_effect)
    out = stored.detach().clone()
    rows = torch.tensor(bad, dtype=torch.long, device=stored.device)
    out.reshape(values.shape)[rows] = fallback.to(out.dtype).to(out.device)
    return out


def _values(row: torch.Tensor) -> str:
    return "/".join(f"{float(v):.3g}" for v in row)


def _reset_for_tests() -> None:
    global _uncalibrated_warned
    _uncalibrated_warned = False
