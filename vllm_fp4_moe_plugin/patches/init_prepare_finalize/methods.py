# SPDX-License-Identifier: Apache-2.0
"""INIT_PREPARE_FINALIZE design (vLLM 0.11.0): NVFP4 MoE quant methods whose quant config tells
the truth (why: the ledger entries in ``patches/init_prepare_finalize``). The subclasses of
``ModelOptNvFp4FusedMoE`` (modelopt.py:1040) and ``CompressedTensorsW4A4MoeMethod``
(compressed_tensors_moe.py:152) change only the FlashInfer paths; Marlin and vLLM's own CUTLASS
path fall through to the stock methods untouched.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import Parameter

from vllm_fp4_moe_plugin.base.log import get_logger, layer_label
from vllm_fp4_moe_plugin.patches import compat, consistency
from vllm_fp4_moe_plugin.patches.init_prepare_finalize import flashinfer_cutlass
from vllm_fp4_moe_plugin.patches.patching import same_named_subclass
from vllm_fp4_moe_plugin.scales import gate_up, layer_scales, scale_agreement, unloaded

logger = get_logger("methods")

# What stock vLLM 0.11.0 does with such an expert (docs/SUPPORT.md, uncalibrated experts).
_STOCK_UNCALIBRATED = "Stock vLLM 0.11.0 uses it as it is (NaN or wrong outputs). "


class UnsupportedLayoutError(ValueError):
    """A parallel layout the FlashInfer NVFP4 MoE kernels cannot compute correctly."""


def check_flashinfer_layout(layer) -> None:
    """Refuse expert placements FlashInfer 0.3.1 would silently mis-route: it assumes rank r
    owns the contiguous experts ``[E_local*r, E_local*(r+1))`` (fi cutlass_fused_moe_kernels.cuh:
    1936-1938, flashinfer_cutlass_fused_moe_sm100_ops.cu:301-302); vLLM 0.11.0 has no NVFP4 EPLB.
    """
    name = layer_label(layer)
    if getattr(layer, "enable_eplb", False):
        raise UnsupportedLayoutError(
            f"{name}: EPLB (--enable-eplb) is not supported with NVFP4 FlashInfer MoE in vLLM "
            "0.11.0; disable EPLB.")
    ep_size = getattr(layer, "ep_size", 1)
    if ep_size <= 1:
        return
    num_experts = layer.global_num_experts
    if num_experts % ep_size:
        raise UnsupportedLayoutError(
            f"{name}: {num_experts} experts cannot be split evenly over an EP size of {ep_size}; "
            "FlashInfer's NVFP4 MoE kernel needs num_experts % (DP*TP) == 0. Change the "
            "DP/TP sizes or disable expert parallelism.")
    expert_map = getattr(layer, "expert_map", None)
    if expert_map is not None:
        local = layer.local_num_experts
        start = layer.ep_rank * local
        expected = torch.full_like(expert_map, -1)
        expected[start:start + local] = torch.arange(local, dtype=expert_map.dtype,
                                                     device=expert_map.device)
        if not torch.equal(expert_map, expected):
            raise UnsupportedLayoutError(
                f"{name}: EP rank {layer.ep_rank} does not own a contiguous block of experts "
                "(expert placement 'round_robin'?). FlashInfer's NVFP4 MoE kernel requires "
                "--expert-placement-strategy linear.")


class ConsistentNvFp4MoEMixin:
    """Shared overrides; ``_fp4_moe_format`` selects the checkpoint tensor names."""

    _fp4_moe_format: str = ""
    # every activation scale it loads is validated and repaired (unloaded.py fills them)
    fp4_moe_repairs_activation_scales = True

    def _fp4_uses_trtllm(self) -> bool:
        from vllm.model_executor.layers.quantization.utils.flashinfer_utils import (
            FlashinferMoeBackend,
        )
        return (self.allow_flashinfer
                and getattr(self, "flashinfer_moe_backend", None)
                == FlashinferMoeBackend.TENSORRT_LLM)

    def _fp4_uses_cutlass(self) -> bool:
        return bool(self.allow_flashinfer) and not self.use_marlin and not self._fp4_uses_trtllm()

    def create_weights(self, layer, *args: Any, **kwargs: Any):
        if self.allow_flashinfer:
            check_flashinfer_layout(layer)
        if self._fp4_uses_cutlass():
            consistency.expect_layer()
        return super().create_weights(layer, *args, **kwargs)

    def _fp4_validate_checkpoint_scales(self, layer) -> None:
        """Refuse corrupt global scales; give uncalibrated experts the calibrated max amax
        (before vLLM inverts them, and before the DP agreement could carry them)."""
        layer_scales.check_weight_scales(layer, self._fp4_moe_format)
        if not self.use_marlin:  # Marlin never reads activation scales
            layer_scales.repair_activation_scales(layer, self._fp4_moe_format,
                                                  _STOCK_UNCALIBRATED)
        if not unloaded.dummy_weights(layer):  # split gate/up weight scales: GEMM2 carries them
            gate_up.rewrite_raw(layer, self._fp4_moe_format, layer_label(layer))

    def process_weights_after_loading(self, layer) -> None:
        self._fp4_validate_checkpoint_scales(layer)
        super().process_weights_after_loading(layer)
        if self._fp4_uses_cutlass():
            self._fp4_set_cutlass_scales(layer)
            if not compat.builds_modular_kernel():  # the direct call runs: check it here
                consistency.run_check(layer, self.get_fused_moe_quant_config(layer))
        elif self._fp4_uses_trtllm():
            self._fp4_set_trtllm_scales(layer)

    def init_prepare_finalize(self, layer) -> None:
        super().init_prepare_finalize(layer)
        fused = self.fused_experts
        if self._fp4_uses_cutlass() and fused is not None:
            consistency.run_check(layer, self.moe_quant_config, fused.prepare_finalize,
                                  fused.fused_experts)

    def _fp4_set_cutlass_scales(self, layer) -> None:
        if self.moe.moe_parallel_config.dp_size > 1:
            from vllm.distributed import get_ep_group

            g_star = scale_agreement.agree_min_scale(layer.w13_input_scale_quant,
                                            get_ep_group().cpu_group, layer=layer_label(layer))
            chosen = scale_agreement.shared_scalar_scales(g_star, layer.w13_weight_scale_2)
            logger.debug("%s: DP dispatch, one GEMM1 activation scale %.6g for all experts",
                         layer_label(layer), float(g_star))
        else:
            chosen = scale_agreement.per_expert_scales(layer.w13_input_scale_quant, layer.g1_alphas)
        layer.fp4_moe_plugin_gemm1 = chosen

    def _fp4_set_trtllm_scales(self, layer) -> None:
        """TRT-LLM ("latency") backend: ``apply`` quantizes with element 0 of
        ``w13_input_scale_quant`` (modelopt.py:1445-1449) while ``g1_alphas`` / ``g1_scale_c``
        are per expert. The rank that computes quantizes (no prepare/finalize here), so every
        element becomes the min over local experts and both GEMM1 output scales are rebuilt."""
        vec = layer.w13_input_scale_quant.data
        g = vec.float().min()
        ws2 = layer.w13_weight_scale_2.data.float()
        g1_alphas = (ws2 / g).to(torch.float32)
        layer.w13_input_scale_quant = Parameter(torch.full_like(vec, g), requires_grad=False)
        layer.g1_alphas = Parameter(g1_alphas, requires_grad=False)
        layer.g1_scale_c = Parameter(
            (layer.w2_input_scale_quant.data.float() * g1_alphas).to(torch.float32),
            requires_grad=False)

    def get_fused_moe_quant_config(self, layer):
        config = super().get_fused_moe_quant_config(layer)
        chosen = getattr(layer, "fp4_moe_plugin_gemm1", None)
        if config is None or not self._fp4_uses_cutlass() or chosen is None:
            return config
        from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

        return nvfp4_moe_quant_config(
            g1_alphas=chosen.g1_alphas, a1_gscale=chosen.a1_gscale,
            g2_alphas=layer.g2_alphas, a2_gscale=layer.w2_input_scale_quant,
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale)

    def maybe_make_prepare_finalize(self):
        if not self._fp4_uses_cutlass():
            return super().maybe_make_prepare_finalize()
        return flashinfer_cutlass.make_prepare_finalize(self.moe)

    def select_gemm_impl(self, prepare_finalize, layer):
        if not self._fp4_uses_cutlass():
            return super().select_gemm_impl(prepare_finalize, layer)
        assert self.moe_quant_config is not None
        return flashinfer_cutlass.make_experts(self.moe, self.moe_quant_config)


def build_modelopt_method(original: type) -> type:
    return same_named_subclass(original, ConsistentNvFp4MoEMixin, __name__,
                               _fp4_moe_format="modelopt")


def build_compressed_tensors_method(original: type) -> type:
    return same_named_subclass(original, ConsistentNvFp4MoEMixin, __name__,
                               _fp4_moe_format="compressed-tensors")
