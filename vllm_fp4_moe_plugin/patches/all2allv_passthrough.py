"""vLLM 0.11.1-era FlashInfer all-to-all prepare: pass bf16 through when there is no DP.

With ``--all2all-backend flashinfer_all2allv`` and DP=1 (pure TP or TP+EP), vLLM builds
``FlashInferAllToAllMoEPrepareAndFinalize(use_dp=False)`` (v0111/v0120 fp4 utils
``build_flashinfer_fp4_cutlass_moe_prepare_finalize``). Its ``prepare`` still quantizes with
element 0 of the per-expert scale (v0120 PF:104-114), while ``FlashInferExperts(use_dp=False)``
sizes the output for bf16 input (v0120 FX:128): the layer cannot run. The all-gather prepare
got the fix in #27223 (v0120 PF:184-185); this subclass gives the all-to-all one the same
``not use_dp`` branch and leaves the DP branch exactly as upstream wrote it.
"""

from __future__ import annotations


def build_all2allv_prepare(original: type) -> type:
    def prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                apply_router_weight_on_input, quant_config, *args, **kwargs):
        if not self.use_dp and quant_config.quant_dtype == "nvfp4":
            self._apply_router_weight_on_input(a1, topk_weights, topk_ids,
                                               apply_router_weight_on_input)
            return a1, None, None, topk_ids, topk_weights
        return original.prepare(self, a1, topk_weights, topk_ids, num_experts, expert_map,
                                apply_router_weight_on_input, quant_config, *args, **kwargs)

    return type(original.__name__, (original,),
                {"prepare": prepare, "fp4_moe_bf16_passthrough": True,
                 "__doc__": original.__doc__, "__module__": __name__})
