# SPDX-License-Identifier: Apache-2.0
"""The MODULAR_METHOD design's slice of the ledger (vLLM 0.11.1-0.13.0). vLLM-free.

Upstream fixed TP (#27223) and ModelOpt DP (#26135); each entry below is a hole left, needed only
while its probe (``probe.py``) still sees it; each replacement is a module of this folder.
"""

from __future__ import annotations

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.modular_method import probe
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, Slice

_HERE = __name__


def _modelopt_needed(findings) -> bool:
    """This release has the ModelOpt NVFP4 MoE method with its process_weights_after_loading
    (no release of the design repairs or refuses its dead expert scales)."""
    return bool(findings["modelopt_nvfp4_moe_method"])


def modelopt_method_as_installed(_original):
    """The ModelOpt method class in its module now: the ModelOpt entry's subclass."""
    import importlib

    return importlib.import_module(vm.MODELOPT).ModelOptNvFp4FusedMoE


def _modelopt_method_cls_needed(findings) -> bool:
    """This release's ModelOpt NVFP4 config creates its MoE method from the class attribute
    FusedMoEMethodCls (v0120 Q/modelopt.py:181, :1636), bound at import."""
    return bool(findings["modelopt_nvfp4_moe_method"]
                and findings["modelopt_method_cls_attr"])


def _ct_dp_needed(name: str):
    def needed(findings) -> bool:
        """This release names the method so, and it still hands DP a per-expert scale (P4)."""
        return (findings["compressed_tensors_class"] == name
                and not findings["compressed_tensors_dp_scale_shared"])
    return needed


def _all2allv_needed(findings) -> bool:
    """The all-to-all prepare still quantizes without DP (P6)."""
    return bool(findings["all2allv_tp_prequantizes"])


_CT_DP_WHY = ("vLLM 0.11.1 fixed ModelOpt's DP path (#26135) but not compressed-tensors': with DP "
              "dispatch its per-expert w13_input_scale_quant is still pre-quantized with element "
              "0 while g1_alphas stay per expert (v0111 CT:358-368, v0120 CT:378-393).")
_CT_DP_HOW = ("Same-named subclass rebound where get_moe_method looks it up: dead or missing "
              "input scales repaired, split gate/up carried by GEMM2; with DP + FlashInfer "
              "CUTLASS, one EP-group min scale, g1_alphas rebuilt (compressed_tensors_dp.py).")

PATCHES = (
    *(ModulePatch(
        module=vm.COMPRESSED_TENSORS_MOE, attr=name,
        build=f"{_HERE}.compressed_tensors_dp:build_compressed_tensors_dp_method",
        needed=_ct_dp_needed(name),
        why=f"{_CT_DP_WHY} Name used by vLLM {releases}.",
        how=_CT_DP_HOW,
        upstream=("None in the modular_method design (0.11.1-0.13.0); 0.14.0 changed the "
                  "design (#31692). See docs/SUPPORT.md."),
        remove_when=("compat finding 'compressed_tensors_dp_scale_shared' turns true (its "
                     "behavioural probe sees one shared scale), or 0.13.0 leaves support."),
    ) for name, releases in zip(vm.CT_NVFP4_CLASS_NAMES,
                                ("0.11.1 and 0.11.2",
                                 "0.12.0 and 0.13.0 (renamed there, v0120 CT:195)"))),
    ModulePatch(
        module=vm.MODELOPT, attr="ModelOptNvFp4FusedMoE", needed=_modelopt_needed,
        build=f"{_HERE}.modelopt_uncalibrated:build_modelopt_method",
        why=("ModelOpt exports can omit the input_scale of experts no calibration token reached "
             "(vllm#45212), or store NaN, inf, 0 or a denormal; with FlashInfer vLLM collapses "
             "every expert to the max (v0120 Q/modelopt.py:1348-1357): one such value becomes "
             "every token's scale (an all-zero or NaN layer, measured)."),
        how=("Same-named subclass rebound where ModelOptConfig.get_quant_method looks it up: "
             "before upstream's process_weights_after_loading, weight scales checked, dead or "
             "missing input scales repaired, split gate/up carried by GEMM2 (gate_up.py)."),
        upstream=("vllm#45320 (open) would refuse such checkpoints with a ValueError; vllm#54444 "
                  "(open) likewise; none in 0.11.1-0.13.0."),
        remove_when=("the design goes (delete this folder when 0.13.0 is no longer supported), "
                     "or compat finding 'modelopt_nvfp4_moe_method' turns false."),
    ),
    ModulePatch(
        module=vm.MODELOPT, attr="ModelOptNvFp4Config.FusedMoEMethodCls",
        build=f"{_HERE}:modelopt_method_as_installed", needed=_modelopt_method_cls_needed,
        why=("ModelOptNvFp4Config.get_quant_method instantiates self.FusedMoEMethodCls, a class "
             "attribute bound to ModelOptNvFp4FusedMoE when the module is imported (v0120 "
             "Q/modelopt.py:181, :1636): rebinding the module attribute alone leaves vLLM "
             "creating the unpatched method."),
        how=("The class attribute is rebound to the same subclass the entry above installs "
             "(applied after it, reverted before it); nothing else."),
        upstream="None (the binding is how the design picks the method class).",
        remove_when=("with the entry above, or when compat finding 'modelopt_method_cls_attr' "
                     "turns false (vLLM looks the method up by module name again)."),
    ),
    ModulePatch(
        module=vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE,
        attr="FlashInferAllToAllMoEPrepareAndFinalize",
        build=f"{_HERE}.all2allv_passthrough:build_all2allv_prepare",
        needed=_all2allv_needed,
        why=("With --all2all-backend flashinfer_all2allv and DP=1, the all-to-all prepare still "
             "quantizes with element 0 of the per-expert scale (v0120 PF:104-114), while "
             "FlashInferExperts(use_dp=False) sizes its output for bf16 input: the layer fails "
             "(ModelOpt and compressed-tensors alike)."),
        how=("Same-named subclass rebound in its module, where create_flashinfer_prepare_"
             "finalize looks it up at call time; prepare() passes bf16 through when not use_dp "
             "(upstream's all-gather rule, #27223; patches/bf16_passthrough.py); the DP branch "
             "is upstream's."),
        upstream=("None in 0.11.1-0.13.0 (the all-gather twin was fixed in #27223); 0.14.0 "
                  "builds MoEPrepareAndFinalizeNoEP without DP instead."),
        remove_when=("compat finding 'all2allv_tp_prequantizes' is false (the behavioural probe "
                     "sees prepare return bf16 input unchanged)."),
    ),
)
# Nothing needed means upstream computes right: every hole of this design is fixed upstream.
SLICE = Slice(Design.MODULAR_METHOD, PATCHES, probe.FINDINGS, probe.observe,
              active=("compressed-tensors DP dispatch (and TP with flashinfer_all2allv) still "
                      "quantize with expert 0's scale"),
              nothing_needed="no hole left that this plugin fixes", nothing_needed_is_fixed=True)
