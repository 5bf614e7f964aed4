# SPDX-License-Identifier: Apache-2.0
"""MODULAR_METHOD design (vLLM 0.11.1-0.13.0): compressed-tensors NVFP4 MoE gets one shared
GEMM1 scale under DP dispatch. Why and how: its ledger entry (``patches/modular_method``). The
shared scale is the min over the whole EP group: what ModelOpt's global max of ``input_scale`` is
(#26135), in compressed-tensors' inverted convention (docs/ROOT-CAUSE.md §10, P5).
"""

from __future__ import annotations

import torch
from torch.nn import Parameter

from vllm_fp4_moe_plugin.base.log import get_logger, layer_label
from vllm_fp4_moe_plugin.patches import compat, consistency
from vllm_fp4_moe_plugin.patches.patching import same_named_subclass
from vllm_fp4_moe_plugin.scales import gate_up, layer_scales, scale_agreement, unloaded

logger = get_logger("compressed_tensors_dp")

_RAW = layer_scales.RAW_SCALES["compressed-tensors"]


class SharedGemm1ScaleForDpMixin:
    """Overrides of the modular_method compressed-tensors NVFP4 MoE method (module docstring)."""

    # every activation scale it loads is repaired (unloaded.py fills them): Marlin reads none
    fp4_moe_repairs_activation_scales = True

    def _fp4_uses_cutlass(self) -> bool:
        from vllm.model_executor.layers.quantization.utils.flashinfer_utils import (
            FlashinferMoeBackend,
        )
        # 0.11.1/0.11.2 have no TRT-LLM path for compressed-tensors, hence no
        # flashinfer_moe_backend attribute: FlashInfer there always means CUTLASS (v0111 CT:191).
        backend = getattr(self, "flashinfer_moe_backend", FlashinferMoeBackend.CUTLASS)
        return (bool(getattr(self, "allow_flashinfer", False))
                and not getattr(self, "use_marlin", False)
                and backend == FlashinferMoeBackend.CUTLASS)

    def _fp4_dp_dispatch(self) -> bool:
        """DP prepares quantize before dispatch (v0111 fp4 utils: use_dp = dp_size > 1)."""
        return self._fp4_uses_cutlass() and self.moe.moe_parallel_config.dp_size > 1

    def process_weights_after_loading(self, layer) -> None:
        dp = self._fp4_dp_dispatch()
        if dp and not unloaded.dummy_weights(layer):  # validate what we reduce over, first
            for attr in _RAW["input"] + _RAW["weight"]:
                layer_scales.check_positive_finite(getattr(layer, attr), layer=layer_label(layer),
                                             name=attr, activation=attr in _RAW["input"])
        if not getattr(self, "use_marlin", False):  # every path that reads activation scales
            self._fp4_repair_uncalibrated(layer)
        if not unloaded.dummy_weights(layer):  # split gate/up weight scales: GEMM2 carries them
            gate_up.rewrite_raw(layer, "compressed-tensors", layer_label(layer))
        super().process_weights_after_loading(layer)
        if dp:
            self._fp4_share_gemm1_scale(layer)

    def _fp4_repair_uncalibrated(self, layer) -> None:
        """Before stock inverts a 0 to inf per expert, and before the DP agreement could carry
        an uncalibrated scale to every rank."""
        layer_scales.repair_activation_scales(layer, "compressed-tensors")

    def _fp4_share_gemm1_scale(self, layer) -> None:
        from vllm.distributed import get_ep_group

        group = get_ep_group().cpu_group
        vec = layer.w13_input_scale_quant.data
        g_min, g_max = scale_agreement.agree_min_max(vec, group, layer=layer_label(layer))
        if torch.equal(g_min, g_max):  # already one value on every rank: nothing to fix
            logger.debug("%s: GEMM1 activation scales already shared (%.6g)", layer_label(layer),
                         float(g_min))
            return
        chosen = scale_agreement.shared_scalar_scales(g_min, layer.w13_weight_scale_2.data)
        layer.w13_input_scale_quant = Parameter(
            chosen.a1_gscale.to(vec.dtype).expand(vec.shape).contiguous(), requires_grad=False)
        layer.g1_alphas = Parameter(chosen.g1_alphas.to(layer.g1_alphas.dtype),
                                    requires_grad=False)
        logger.debug("%s: DP dispatch, one GEMM1 activation scale %.6g for all experts",
                     layer_label(layer), float(g_min))

    def select_gemm_impl(self, prepare_finalize, layer):
        experts = super().select_gemm_impl(prepare_finalize, layer)
        if self._fp4_uses_cutlass():  # read-only: the load-time check of what was built
            consistency.run_check(layer, self.moe_quant_config, prepare_finalize, experts)
        return experts

    def create_weights(self, layer, *args, **kwargs):
        # The check runs where a modular kernel is built; one GPU runs upstream's direct call.
        if self._fp4_uses_cutlass() and compat.builds_modular_kernel():
            consistency.expect_layer()
        return super().create_weights(layer, *args, **kwargs)


def build_compressed_tensors_dp_method(original: type) -> type:
    return same_named_subclass(original, SharedGemm1ScaleForDpMixin, __name__)
