# SPDX-License-Identifier: Apache-2.0
"""MODULAR_METHOD design: without DP the FlashInfer all-to-all prepare passes bf16 through
(:mod:`..bf16_passthrough`), as the all-gather one does since #27223 (v0120 PF:184-185):
``FlashInferExperts(use_dp=False)`` sizes its output for bf16 (v0120 FX:128). Why: its ledger
entry (``patches/modular_method``)."""

from __future__ import annotations

from vllm_fp4_moe_plugin.patches.bf16_passthrough import Bf16PassthroughPrepareMixin
from vllm_fp4_moe_plugin.patches.patching import same_named_subclass


def build_all2allv_prepare(original: type) -> type:
    return same_named_subclass(original, Bf16PassthroughPrepareMixin, __name__)
