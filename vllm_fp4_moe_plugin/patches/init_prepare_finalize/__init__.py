# SPDX-License-Identifier: Apache-2.0
"""The INIT_PREPARE_FINALIZE design's slice of the ledger (vLLM 0.11.0): every FlashInfer NVFP4
MoE layout quantizes with expert 0's GEMM1 scale (docs/ROOT-CAUSE.md §1-§6). Three entries that go
together, needed while the code has neither upstream fix (#27223, #26135). The folder: these
records, ``probe.py``, the methods (``methods.py``), the direct call (``flashinfer_cutlass.py``).
"""

from __future__ import annotations

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.init_prepare_finalize import probe
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, Slice


def _unfixed(findings) -> bool:
    """Neither upstream fix is present (compat P1, P2)."""
    return not findings["tp_fix_present"] and not findings["modelopt_dp_fix_present"]


_REMOVE_WHEN = ("with vLLM 0.11.0's support (delete the folder); it stands down where finding "
                "'tp_fix_present' or 'modelopt_dp_fix_present' is true.")

_HERE = __name__
PATCHES = (
    ModulePatch(
        module=vm.MODELOPT, attr="ModelOptNvFp4FusedMoE",
        build=f"{_HERE}.methods:build_modelopt_method", needed=_unfixed,
        why=("Its quant config gives the FlashInfer CUTLASS prepare step a per-expert GEMM1 "
             "activation-scale vector, of which fp4_quantize reads only element 0, while GEMM1 "
             "is dequantized per expert: wrong results whenever experts' input scales differ "
             "(gsm8k 0.01 for DeepSeek-R1-0528-FP4-v2 at TP=4+EP). The TRT-LLM backend has the "
             "same flaw."),
        how=("Same-named subclass, rebound where get_quant_method looks it up (modelopt.py:823): "
             "scales checked, repaired, split gate/up carried by GEMM2 (gate_up.py); per-expert "
             "scales TP-like, one EP-group scalar for DP; bf16 passthrough without DP."),
        upstream=("vllm-project/vllm#27223 (TP passthrough) and #26135 (global input scale for "
                  "DP), both first released in vLLM 0.11.1."),
        remove_when=_REMOVE_WHEN,
    ),
    ModulePatch(
        module=vm.COMPRESSED_TENSORS_MOE, attr="CompressedTensorsW4A4MoeMethod",
        build=f"{_HERE}.methods:build_compressed_tensors_method", needed=_unfixed,
        why=("Same defect as ModelOpt: per-expert w13_input_scale_quant pre-quantized with "
             "element 0 in every FlashInfer CUTLASS layout."),
        how=("Subclass with the same name, rebound where CompressedTensorsMoEMethod."
             "get_moe_method looks it up (compressed_tensors_moe.py:134); same overrides as the "
             "ModelOpt entry."),
        upstream=("TP: vllm-project/vllm#27223 (0.11.1). DP: open in 0.11.1-0.13.0 (modular_method "
                  "entry); DP+EP open through 0.34.0 without --enable-eplb (nvfp4_oracle entry)."),
        remove_when=_REMOVE_WHEN,
    ),
    ModulePatch(
        module=vm.FLASHINFER_CUTLASS_MOE, attr="flashinfer_cutlass_moe_fp4",
        build=f"{_HERE}.flashinfer_cutlass:build_direct_call", needed=_unfixed,
        why=("The direct path (single GPU, PP with TP=1: EP group of one, so no modular kernel "
             "is built) pre-quantizes with element 0 too, and its FlashInferExperts sizes the "
             "output (M, 2H) for bf16 input."),
        how=("Module attribute rebound; both NVFP4 methods import it from this module at call "
             "time (modelopt.py:1559, compressed_tensors_moe.py:448). The replacement builds the "
             "passthrough prepare and the output-shape-fixed experts."),
        upstream="vllm-project/vllm#27223 (direct call passes use_dp=False), vLLM 0.11.1.",
        remove_when=_REMOVE_WHEN,
    ),
)
# Nothing needed is not a fix: a partial backport the plugin cannot help; stock may be wrong.
SLICE = Slice(Design.INIT_PREPARE_FINALIZE, PATCHES, probe.FINDINGS, probe.observe,
              active="every FlashInfer prepare quantizes with expert 0's GEMM1 scale",
              nothing_needed=("vLLM already carries part of the upstream fix (#27223/#26135); "
                              "these patches would fight it"))
