# SPDX-License-Identifier: Apache-2.0
"""The bf16-passthrough prepare, shared by the designs that need it. vLLM-free.

Without DP dispatch, FlashInfer CUTLASS handed bf16 quantizes every token with its expert's scale,
the one ``g1_alphas`` fold in, as upstream's all-gather prepare does since 0.11.1 (v0111
PF:184-185, #27223); 0.11.0's prepares and 0.11.1-0.13.0's all-to-all one (v0120 PF:104-114) use
element 0 of the per-expert scale instead."""

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
