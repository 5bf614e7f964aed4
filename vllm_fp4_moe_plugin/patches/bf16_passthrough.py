# SPDX-License-Identifier: Apache-2.0
"""The bf16-passthrough prepare, shared by the designs that need it. vLLM-free.

Without DP dispatch there is no reason to quantize NVFP4 activations before the FlashInfer
CUTLASS kernel: handed bf16, the kernel quantizes every token with the scale of the expert it is
routed to, the same scale ``g1_alphas`` fold in. Upstream's all-gather prepare does this since
vLLM 0.11.1 (v0111 PF:184-185, #27223); vLLM 0.11.0's prepares and the 0.11.1-era all-to-all one
(v0120 PF:104-114) quantize with element 0 of the per-expert scale instead.
"""

from __future__ import annotations


class Bf16PassthroughPrepareMixin:
    """Put before a FlashInfer prepare/finalize class: without DP, ``prepare`` applies the
    router weight (if asked) and returns the bf16 input itself; with DP it is the class's own.
    ``fp4_moe_bf16_passthrough`` tells ``consistency`` so, without it importing the patches."""

    fp4_moe_bf16_passthrough = True

    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, *args, **kwargs):
        if self.use_dp or quant_config.quant_dtype != "nvfp4":
            return super().prepare(a1, topk_weights, topk_ids, num_experts, expert_map,
                                   apply_router_weight_on_input, quant_config, *args, **kwargs)
        self._apply_router_weight_on_input(a1, topk_weights, topk_ids,
                                           apply_router_weight_on_input)
        return a1, None, None, topk_ids, topk_weights
