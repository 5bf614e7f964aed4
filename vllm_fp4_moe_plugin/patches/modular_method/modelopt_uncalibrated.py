# SPDX-License-Identifier: Apache-2.0
"""MODULAR_METHOD design (vLLM 0.11.1-0.13.0): ModelOpt NVFP4 MoE with its dead or missing expert
scales repaired before upstream's ``process_weights_after_loading``, as in every other design
(``layer_scales``). Why and how: its ledger entry (``patches/modular_method``)."""

from __future__ import annotations

from vllm_fp4_moe_plugin.base.log import layer_label
from vllm_fp4_moe_plugin.patches.patching import same_named_subclass
from vllm_fp4_moe_plugin.scales import gate_up, layer_scales, unloaded

_STOCK_UNCALIBRATED = ("Stock vLLM collapses the layer's activation scales to their max with the "
                       "FlashInfer backends: a NaN, infinite or huge one becomes the scale of "
                       "every token. ")


class RepairedModelOptMixin:
    """Overrides of ``ModelOptNvFp4FusedMoE`` (module docstring)."""

    # every activation scale it loads is repaired (unloaded.py fills them): Marlin reads none
    fp4_moe_repairs_activation_scales = True

    def process_weights_after_loading(self, layer) -> None:
        layer_scales.check_weight_scales(layer, "modelopt")
        if not getattr(self, "use_marlin", False):
            layer_scales.repair_activation_scales(layer, "modelopt", _STOCK_UNCALIBRATED)
        if not unloaded.dummy_weights(layer):  # split gate/up weight scales: GEMM2 carries them
            gate_up.rewrite_raw(layer, "modelopt", layer_label(layer))
        super().process_weights_after_loading(layer)


def build_modelopt_method(original: type) -> type:
    return same_named_subclass(original, RepairedModelOptMixin, __name__)
