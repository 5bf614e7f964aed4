"""MODULAR_METHOD design: the FlashInfer all-to-all prepare passes bf16 through without DP.

With ``--all2all-backend flashinfer_all2allv`` and DP=1 (pure TP or TP+EP), vLLM builds
``FlashInferAllToAllMoEPrepareAndFinalize(use_dp=False)`` (v0111/v0120 fp4 utils
``build_flashinfer_fp4_cutlass_moe_prepare_finalize``). Its ``prepare`` still quantizes with
element 0 of the per-expert scale (v0120 PF:104-114), while ``FlashInferExperts(use_dp=False)``
sizes the output for bf16 input (v0120 FX:128): the layer cannot run. The all-gather prepare
got the fix in #27223 (v0120 PF:184-185); this subclass gives the all-to-all one the same
``not use_dp`` branch (:mod:`..bf16_passthrough`) and leaves the DP branch as upstream wrote it.
"""

from __future__ import annotations

from vllm_fp4_moe_plugin.patches.bf16_passthrough import Bf16PassthroughPrepareMixin
from vllm_fp4_moe_plugin.patching import same_named_subclass


def build_all2allv_prepare(original: type) -> type:
    return same_named_subclass(original, Bf16PassthroughPrepareMixin, __name__)
