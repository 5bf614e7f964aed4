"""The patch ledger: every vLLM symbol this plugin replaces, and why.

Each entry says why it exists, how it works, which upstream change fixes the same thing, when to
delete it (the vllm-ascend ledger format), and which MoE design (``compat.DESIGN_*``) it belongs
to. ``compat.probe()`` picks the design and the entries whose hole the installed vLLM still has;
nothing else is ever applied. ``docs/PATCHES.md`` is generated from this list
(``python -m vllm_fp4_moe_plugin.patches``) and a test keeps the two in sync.
"""

from __future__ import annotations

from vllm_fp4_moe_plugin.compat import DESIGN_0_11_0, DESIGN_0_11_1, DESIGN_0_14_0
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, applied_targets

_MO = "vllm.model_executor.layers.quantization.modelopt"
_CT = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
_FX = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe"
_PF = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize"
_ORACLE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"


def _build_modelopt(original):
    from vllm_fp4_moe_plugin.patches.nvfp4_moe_methods import build_modelopt_method
    return build_modelopt_method(original)


def _build_compressed_tensors(original):
    from vllm_fp4_moe_plugin.patches.nvfp4_moe_methods import build_compressed_tensors_method
    return build_compressed_tensors_method(original)


def _build_compressed_tensors_dp(original):
    from vllm_fp4_moe_plugin.patches.compressed_tensors_dp import (
        build_compressed_tensors_dp_method)
    return build_compressed_tensors_dp_method(original)


def _build_all2allv(original):
    from vllm_fp4_moe_plugin.patches.all2allv_passthrough import build_all2allv_prepare
    return build_all2allv_prepare(original)


_CT_DP_WHY = ("vLLM 0.11.1 fixed ModelOpt's DP path (#26135) but not compressed-tensors': with DP "
              "dispatch its per-expert w13_input_scale_quant is still pre-quantized with element "
              "0 while g1_alphas stay per expert (v0111 CT:358-368, v0120 CT:378-393).")
_CT_DP_HOW = ("Subclass with the same name, rebound where CompressedTensorsMoEMethod."
              "get_moe_method looks it up. Only with DP + FlashInfer CUTLASS: validates the raw "
              "scales, runs upstream's process_weights_after_loading, then sets every element of "
              "w13_input_scale_quant to the MIN over the EP group and rebuilds g1_alphas (no-op "
              "when the group's scales are already equal). select_gemm_impl adds the read-only "
              "load-time check. TP layouts, Marlin, TRT-LLM, CuteDSL: upstream code unchanged.")


def _build_agreed_prepare(original):
    from vllm_fp4_moe_plugin.patches.ep_agreed_gemm1_scale import build_agreed_prepare
    return build_agreed_prepare(original)


def _build_direct_call(original):
    from vllm_fp4_moe_plugin.patches.flashinfer_cutlass import flashinfer_cutlass_moe_fp4
    return flashinfer_cutlass_moe_fp4


LEDGER: tuple[ModulePatch, ...] = (
    ModulePatch(
        module=_MO, attr="ModelOptNvFp4FusedMoE", build=_build_modelopt,
        designs=(DESIGN_0_11_0,),
        why=("Its quant config gives the FlashInfer CUTLASS prepare step a per-expert GEMM1 "
             "activation-scale vector, of which fp4_quantize reads only element 0, while GEMM1 "
             "is dequantized per expert: wrong results whenever experts' input scales differ "
             "(gsm8k 0.01 for DeepSeek-R1-0528-FP4-v2 at TP=4+EP). The TRT-LLM backend has the "
             "same flaw."),
        how=("Subclass with the same name, rebound where ModelOptNvFp4Config.get_quant_method "
             "looks it up (modelopt.py:823). Overrides process_weights_after_loading (validate "
             "scales; per-expert scales for TP-like layouts, one EP-group-wide scalar with rebuilt "
             "g1_alphas for DP; one scalar for TRT-LLM), get_fused_moe_quant_config, "
             "maybe_make_prepare_finalize (bf16 passthrough when not DP), select_gemm_impl, "
             "create_weights (layout guards) and init_prepare_finalize (the load-time "
             "consistency check). Marlin and vLLM CUTLASS paths call the originals."),
        upstream=("vllm-project/vllm#27223 (TP passthrough) and #26135 (global input scale for "
                  "DP), both first released in vLLM 0.11.1."),
        remove_when=("The installed vLLM has the 0.11.1 MoE design (compat probe "
                     "'tp_fix_present' and 'modelopt_dp_fix_present'); the plugin then does not "
                     "install this patch."),
    ),
    ModulePatch(
        module=_CT, attr="CompressedTensorsW4A4MoeMethod", build=_build_compressed_tensors,
        designs=(DESIGN_0_11_0,),
        why=("Same defect as ModelOpt: per-expert w13_input_scale_quant pre-quantized with "
             "element 0 in every FlashInfer CUTLASS layout."),
        how=("Subclass with the same name, rebound where CompressedTensorsMoEMethod."
             "get_moe_method looks it up (compressed_tensors_moe.py:134); same overrides as the "
             "ModelOpt entry."),
        upstream=("TP layouts: vllm-project/vllm#27223 (0.11.1). DP layouts: still open in "
                  "0.11.1-0.13.0 (the 0.11.1-design entry below); 0.14.0's oracle (#31692) fixes "
                  "DP without EP; DP+EP stays open upstream through 0.34.0 except with "
                  "--enable-eplb (0.28.0+), and is the 0.14.0-design entry below. See "
                  "docs/SUPPORT.md."),
        remove_when=("Never on 0.11.0. On later releases only the DP part remains needed; see "
                     "the support matrix."),
    ),
    ModulePatch(
        module=_FX, attr="flashinfer_cutlass_moe_fp4", build=_build_direct_call,
        designs=(DESIGN_0_11_0,),
        why=("The direct path (single GPU, PP with TP=1: EP group of one, so no modular kernel "
             "is built) pre-quantizes with element 0 too, and its FlashInferExperts sizes the "
             "output (M, 2H) for bf16 input."),
        how=("Module attribute rebound; both NVFP4 methods import it from this module at call "
             "time (modelopt.py:1559, compressed_tensors_moe.py:448). The replacement builds the "
             "passthrough prepare and the output-shape-fixed experts."),
        upstream="vllm-project/vllm#27223 (direct call passes use_dp=False), vLLM 0.11.1.",
        remove_when="Same probe as the ModelOpt entry (tp_fix_present).",
    ),
    *(ModulePatch(
        module=_CT, attr=name, build=_build_compressed_tensors_dp, designs=(DESIGN_0_11_1,),
        why=f"{_CT_DP_WHY} Name used by vLLM {releases}.",
        how=_CT_DP_HOW,
        upstream=("None in the 0.11.1 design (0.11.1-0.13.0); 0.14.0 changed the design "
                  "(#31692). See docs/SUPPORT.md."),
        remove_when=("A release gives compressed-tensors one shared GEMM1 scale under DP (the "
                     "matrix test on that release shows stock consistent), or leaves the 0.11.1 "
                     "design (compat probe 'design_0_11_1' false)."),
    ) for name, releases in (("CompressedTensorsW4A4MoeMethod", "0.11.1 and 0.11.2"),
                             ("CompressedTensorsW4A4Nvfp4MoEMethod",
                              "0.12.0 and 0.13.0 (renamed there, v0120 CT:195)"))),
    ModulePatch(
        module=_PF, attr="FlashInferAllToAllMoEPrepareAndFinalize", build=_build_all2allv,
        designs=(DESIGN_0_11_1,),
        why=("With --all2all-backend flashinfer_all2allv and DP=1, the all-to-all prepare still "
             "quantizes with element 0 of the per-expert scale (v0120 PF:104-114), while "
             "FlashInferExperts(use_dp=False) sizes its output for bf16 input: the layer fails "
             "(ModelOpt and compressed-tensors alike)."),
        how=("Same-named subclass rebound in its module, where create_flashinfer_prepare_"
             "finalize looks it up at call time; prepare() passes bf16 through when not use_dp "
             "(upstream's all-gather rule, #27223); the DP branch is upstream's."),
        upstream=("None in 0.11.1-0.13.0 (the all-gather twin was fixed in #27223); 0.14.0 "
                  "builds MoEPrepareAndFinalizeNoEP without DP instead."),
        remove_when=("compat probe 'all2allv_tp_prequantizes' is false (the behavioural probe "
                     "sees prepare return bf16 input unchanged)."),
    ),
    *(ModulePatch(
        module=_ORACLE, attr=name, build=_build_agreed_prepare, designs=(DESIGN_0_14_0,),
        why=("vLLM 0.14.0+ collapses GEMM1's activation scales to the max amax over the experts "
             "a rank loaded; compressed-tensors loads only the rank's local experts (its "
             "use_global_sf never reaches the loader, v0.34.0 FM/routed_experts.py:764-771), so "
             "under DP+EP a sender-side dispatcher (the default allgather_reducescatter, "
             "FlashInfer NVLink one/two-sided, DeepEP-LL with NVFP4 dispatch) quantizes with the "
             "sender's max while the owning rank's g1_alphas fold in its own: GEMM1 off by their "
             "ratio. " + what),
        how=("Wrapper rebound in the oracle module, where convert_to_nvfp4_moe_kernel_format "
             "looks the helper up at call time. Validates the checkpoint's global scales; when "
             "the layer uses the all-to-all kernels with EP > 1, a global-scale backend and a "
             "sender-side dispatcher (and not EPLB on 0.28.0+, which already agrees), replaces "
             "a13_scale by the EP group's max (one MAX all-reduce of a scalar per layer, at "
             "load) before upstream's code collapses it and folds it into g1_alphas. Every other "
             "call passes its arguments through unchanged; ModelOpt's local max already is the "
             "global one, so its values do not change."),
        upstream=("Open as of vLLM 0.34.0; #48355 (0.28.0) agrees the scale only with "
                  "--enable-eplb. An upstream fix would load compressed-tensors' input global "
                  "scales for every expert (as ModelOpt does) or all-reduce whenever the "
                  "all-to-all kernels are used."),
        remove_when=("A release's focused suite (tests/newest on that release) shows stock "
                     "compressed-tensors consistent on the dp_ep rows; or compat probe "
                     "'oracle_helpers_take_layer_and_a13_scale' turns false (the plugin then "
                     "stays inactive on its own)."),
    ) for name, what in (
        ("prepare_nvfp4_moe_layer_for_fi_or_cutlass",
         "This helper serves FlashInfer TRT-LLM, CUTLASS (and B12X) in every release of the "
         "design, and CuteDSL in 0.14.x."),
        ("prepare_nvfp4_moe_layer_for_flashinfer_cutedsl",
         "This helper serves FlashInfer CuteDSL from vLLM 0.20.0 on."))),
)


def targets_for_design(design: str) -> tuple[str, ...]:
    return tuple(p.target for p in LEDGER if design in p.designs)


def apply_all() -> list[str]:
    """Apply what ``compat.probe()`` asks for on the installed vLLM; returns the targets newly
    replaced (empty if already done, or if the probe says the plugin has nothing to do here)."""
    from vllm_fp4_moe_plugin import compat

    result = compat.probe()
    if not result.install:
        return []
    return apply_targets(result.design, result.patches)


class PatchInstallError(RuntimeError):
    """A patch the probe asked for could not be applied. None of the requested patches is left
    in place; the process must not serve (with the plugin asked for, serving unpatched would be
    the silent wrong answer this plugin exists to prevent)."""

    def __init__(self, target: str, cause: BaseException | str) -> None:
        self.target = target
        why = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"vllm-fp4-moe-plugin could not patch {target} ({why}); no patch is applied and "
            "this process refuses to serve. Set VLLM_FP4_MOE_PLUGIN=0 to run stock vLLM, or "
            "report this with `vllm-fp4-moe doctor` output.")


def apply_targets(design: str, targets) -> list[str]:
    """Apply the ledger entries of ``design`` named in ``targets``: all of them, or none.

    Returns the targets newly replaced. On any failure every requested entry is reverted
    (also those applied by an earlier call) and :class:`PatchInstallError` names the target."""
    wanted = set(targets)
    entries = [p for p in LEDGER if design in p.designs and p.target in wanted]
    unknown = sorted(wanted - {p.target for p in entries})
    if unknown:
        raise PatchInstallError(unknown[0], f"no ledger entry of the {design} design")
    newly: list[str] = []
    for p in entries:
        try:
            if p.apply():
                newly.append(p.target)
        except BaseException as exc:
            _revert_quietly(entries)
            raise PatchInstallError(p.target, exc) from exc
    return newly


def _revert_quietly(entries) -> None:
    for p in reversed(list(entries)):
        try:
            p.revert()
        except Exception:  # keep reverting the others; the caller raises the first failure
            pass


def revert_all() -> list[str]:
    """Revert every applied entry; one that fails does not stop the others (then raises)."""
    reverted, failed = [], []
    for p in reversed(LEDGER):
        try:
            if p.revert():
                reverted.append(p.target)
        except Exception as exc:
            failed.append((p.target, exc))
    if failed:
        target, exc = failed[0]
        raise RuntimeError(f"could not restore vLLM's {target}: {type(exc).__name__}: "
                           f"{exc}") from exc
    return reverted


def render_ledger_markdown() -> str:
    lines = ["# Patch ledger", "",
             "Generated from `vllm_fp4_moe_plugin/patches/__init__.py` by "
             "`python -m vllm_fp4_moe_plugin.patches`; a test keeps it in sync.", ""]
    for p in LEDGER:
        lines += [f"## `{p.target}` (vLLM {', '.join(p.designs)} design)", "",
                  f"- **Why:** {p.why}", f"- **How:** {p.how}",
                  f"- **Upstream:** {p.upstream}", f"- **Remove when:** {p.remove_when}", ""]
    return "\n".join(lines)


__all__ = ["LEDGER", "ModulePatch", "PatchInstallError", "apply_all", "apply_targets",
           "applied_targets", "revert_all", "targets_for_design", "render_ledger_markdown"]
