"""The NVFP4_ORACLE design's slice of the ledger (vLLM 0.14.0-0.34.0): one patch, the EP-agreed
GEMM1 scale, on each scale-collapsing helper the oracle has. vLLM-free.
"""

from __future__ import annotations

from vllm_fp4_moe_plugin import vllm_modules as vm
from vllm_fp4_moe_plugin.patching import ModulePatch
from vllm_fp4_moe_plugin.support import Design

DESIGN = Design.NVFP4_ORACLE
ACTIVE = ("compressed-tensors collapses GEMM1 input scales to each EP rank's local max, which "
          "DP+EP dispatch mixes across ranks")
NOTHING_NEEDED = "the oracle has none of the scale-collapsing helpers this plugin wraps"
# NOTHING_NEEDED is not a fix: the helpers moved, whether upstream fixed the hole is unknown.
NOTHING_NEEDED_IS_FIXED = False


def _build_agreed_prepare(original):
    from vllm_fp4_moe_plugin.patches.nvfp4_oracle.ep_agreed_gemm1_scale import build_agreed_prepare
    return build_agreed_prepare(original)


def _helper_needed(name: str):
    def needed(findings) -> bool:
        """The oracle has this helper (0.20.0+ for the CuteDSL one)."""
        return name in findings["oracle_helpers"]
    return needed


LEDGER: tuple[ModulePatch, ...] = tuple(ModulePatch(
    module=vm.NVFP4_ORACLE, attr=name, build=_build_agreed_prepare, design=DESIGN,
    needed=_helper_needed(name),
    why=("vLLM 0.14.0+ collapses GEMM1's activation scales to the max amax over the experts "
         "a rank loaded; compressed-tensors loads only the rank's local experts (its "
         "use_global_sf never reaches the loader, v0.34.0 FM/routed_experts.py:764-771), so "
         "under DP+EP a sender-side dispatcher (the default allgather_reducescatter, "
         "FlashInfer NVLink one/two-sided, DeepEP-LL with NVFP4 dispatch) quantizes with the "
         "sender's max while the owning rank's g1_alphas fold in its own: GEMM1 off by their "
         "ratio. " + what),
    how=("Wrapper rebound in the oracle module, where convert_to_nvfp4_moe_kernel_format "
         "looks the helper up at call time. Validates the checkpoint's weight global scales "
         "and gives uncalibrated experts' a13_scale/a2_scale entries (scale_check."
         "uncalibrated: any value no calibration produced) the calibrated experts' max amax, "
         "before any collapse; when "
         "the layer uses the all-to-all kernels with EP > 1, a global-scale backend and a "
         "sender-side dispatcher (and not EPLB on 0.28.0+, which already agrees), replaces "
         "a13_scale by the EP group's max (one MAX all-reduce of a scalar per layer, at "
         "load) before upstream's code collapses it and folds it into g1_alphas. Every other "
         "call with calibrated scales passes its arguments through unchanged; ModelOpt's "
         "local max already is the global one, so its values do not change."),
    upstream=("Open as of vLLM 0.34.0; #48355 (0.28.0) agrees the scale only with "
              "--enable-eplb. An upstream fix would load compressed-tensors' input global "
              "scales for every expert (as ModelOpt does) or all-reduce whenever the "
              "all-to-all kernels are used."),
    remove_when=("A release's focused suite (tests/newest on that release) shows stock "
                 "compressed-tensors consistent on the dp_ep rows and stock at the reference on "
                 "the uncalibrated rows (matrix --uncalibrated); or compat finding "
                 "'oracle_helpers_take_layer_and_a13_scale' turns false (the plugin then "
                 "stays inactive on its own)."),
) for name, what in zip(vm.ORACLE_HELPERS, (
    "This helper serves FlashInfer TRT-LLM, CUTLASS (and B12X) in every release of the "
    "design, and CuteDSL in 0.14.x.",
    "This helper serves FlashInfer CuteDSL from vLLM 0.20.0 on.")))
