# SPDX-License-Identifier: Apache-2.0
"""The checkpoint's global scales of one NVFP4 MoE layer, checked (weight) and repaired
(activation: :func:`scales.repair_uncalibrated`) as loaded, before vLLM inverts them and before
any collapse or agreement could carry them to other experts or ranks. Written once for the
quant-method patches of the pre-oracle designs; the oracle wrapper works on the helpers'
arguments instead (nvfp4_oracle/ep_agreed_gemm1_scale.py).
"""

from __future__ import annotations

from vllm_fp4_moe_plugin import scales, unloaded
from vllm_fp4_moe_plugin.log import layer_label, local_experts_note

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
        scales.check_positive_finite(getattr(layer, attr), layer=layer_label(layer), name=attr)


def repair_activation_scales(layer, fmt: str, stock_effect: str = "") -> None:
    """Repair the layer's activation scales in place (a no-op for calibrated checkpoints)."""
    for attr in RAW_SCALES[fmt]["input"]:
        param = getattr(layer, attr)
        scales.check_positive_finite(param, layer=layer_label(layer), name=attr,
                                     activation=True)
        repaired = scales.repair_uncalibrated(
            param.data, reciprocal=fmt == "compressed-tensors", layer=layer_label(layer),
            name=attr, index_note=local_experts_note(layer), stock_effect=stock_effect,
            missing=tuple(unloaded.missing_rows(param.data)))
        if repaired is not param.data:
            param.data.copy_(repaired)
