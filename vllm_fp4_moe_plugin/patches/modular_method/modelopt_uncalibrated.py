"""MODULAR_METHOD design (vLLM 0.11.1-0.13.0): ModelOpt NVFP4 MoE with dead expert scales.

Upstream fixed ModelOpt's GEMM1 scale for every layout in 0.11.1 (#27223, #26135), so the plugin
left this method alone; but it still reads whatever a checkpoint gives as an expert's
``input_scale``, and whatever ``torch.empty`` left when the checkpoint gives none (vllm#45212:
ModelOpt exports omit the ``input_scale`` of experts no calibration token reached). With the
FlashInfer backends it then collapses the layer to the max over experts (v0120
Q/modelopt.py:1348-1357): one absurd or leftover value becomes every token's scale, and the
layer computes nothing (measured on this design's layer: an all-zero output). This subclass
keeps the class name (vLLM checks it, v0111 layer.py:968) and everything upstream does, and only
repairs the checkpoint's scales before upstream's ``process_weights_after_loading``, as the
plugin does in every other design (patches/checkpoint_scales.py).
"""

from __future__ import annotations

import torch

from vllm_fp4_moe_plugin.patches import checkpoint_scales
from vllm_fp4_moe_plugin.patching import same_named_subclass

_STOCK_UNCALIBRATED = ("Stock vLLM collapses the layer's activation scales to their max with the "
                       "FlashInfer backends: a NaN, infinite or huge one becomes the scale of "
                       "every token. ")


class RepairedModelOptMixin:
    """Overrides of ``ModelOptNvFp4FusedMoE`` (module docstring)."""

    # every activation scale it loads is repaired (unloaded.py fills them): Marlin reads none
    fp4_moe_repairs_activation_scales = True

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        checkpoint_scales.check_weight_scales(layer, "modelopt")
        if not getattr(self, "use_marlin", False):
            checkpoint_scales.repair_activation_scales(layer, "modelopt", _STOCK_UNCALIBRATED)
        super().process_weights_after_loading(layer)


def build_modelopt_method(original: type) -> type:
    return same_named_subclass(original, RepairedModelOptMixin, __name__)
