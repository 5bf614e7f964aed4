# SPDX-License-Identifier: Apache-2.0
"""The INIT_PREPARE_FINALIZE design's probe (vLLM 0.11.0): is every symbol its patches replace or
subclass there, with the methods the subclasses override? vLLM-free at import."""

from __future__ import annotations

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.probing import Observation, has, missing_methods

FINDINGS = ("targets_present",)
# If any of these is gone, the design has changed under us.
_TARGETS = (
    (vm.MODELOPT, "ModelOptNvFp4FusedMoE"),
    (vm.COMPRESSED_TENSORS_MOE, "CompressedTensorsW4A4MoeMethod"),
    (vm.FLASHINFER_CUTLASS_MOE, "flashinfer_cutlass_moe_fp4"),
    (vm.FLASHINFER_CUTLASS_MOE, "FlashInferExperts"),
    (vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllGatherMoEPrepareAndFinalize"),
    (vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllToAllMoEPrepareAndFinalize"),
)
_OVERRIDDEN = ("create_weights", "process_weights_after_loading", "get_fused_moe_quant_config",
               "maybe_make_prepare_finalize", "select_gemm_impl", "init_prepare_finalize")


def observe(findings: dict) -> Observation:
    d = Design.INIT_PREPARE_FINALIZE
    missing = [f"{m}.{a}" for m, a in _TARGETS if not has(m, a)]
    findings["targets_present"] = not missing
    if missing:
        return Observation(d, False, "vLLM lacks symbols this plugin replaces: "
                           + ", ".join(missing), findings)
    for mod, cls_name in _TARGETS[:2]:
        gone = missing_methods(mod, cls_name, _OVERRIDDEN)
        if gone:
            return Observation(d, False, f"{cls_name} lacks {', '.join(gone)}", findings)
    return Observation(d, True, "vLLM 0.11.0 MoE design: every FlashInfer prepare quantizes "
                       "with expert 0's GEMM1 scale", findings)
