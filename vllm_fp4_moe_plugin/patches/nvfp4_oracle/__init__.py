# SPDX-License-Identifier: Apache-2.0
"""The NVFP4_ORACLE design's slice of the ledger (vLLM 0.14.0-0.34.0): one wrapper on each
scale-collapsing helper the oracle has, with two duties (the EP-agreed GEMM1 scale, the repair of
uncalibrated expert scales), each dropped where the probe sees upstream do it. vLLM-free.
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


# Each duty of the wrapper, with the finding that sees vLLM do it itself (upstream/0001, 0002),
# and the plan's words when vLLM does one (keyed by the duty left) or both.
UPSTREAM_FIXES = {"agree": "upstream_agrees_gemm1_scale",
                  "repair": "upstream_repairs_uncalibrated"}
PARTLY = {"agree": "upstream repairs uncalibrated expert scales; " + ACTIVE,
          "repair": ("upstream agrees GEMM1's scale over the EP group; stock leaves uncalibrated "
                     "or missing expert activation scales as loaded")}
FIXED = ("upstream already computes right: it agrees the GEMM1 activation scale over the EP "
         "group and repairs uncalibrated expert activation scales itself")


def duties(findings) -> dict[str, bool]:
    """The wrapper's duties this vLLM still needs (``agree``, ``repair``)."""
    return {duty: not findings.get(finding) for duty, finding in UPSTREAM_FIXES.items()}


def describe(findings, needed: bool) -> tuple[str, bool]:
    """The plan's words, and whether standing down means upstream computes right."""
    left = [d for d, todo in duties(findings).items() if todo]
    if needed:
        return (ACTIVE if len(left) == 2 else PARTLY[left[0]]), False
    return (FIXED, True) if not left else (NOTHING_NEEDED, NOTHING_NEEDED_IS_FIXED)


def _build_agreed_prepare(original):
    from vllm_fp4_moe_plugin import compat
    from vllm_fp4_moe_plugin.patches.nvfp4_oracle.ep_agreed_gemm1_scale import build_agreed_prepare
    return build_agreed_prepare(original, **duties(compat.probe_upstream_fixes()))


def _helper_needed(name: str):
    def needed(findings) -> bool:
        """The oracle has this helper (0.20.0+ for the CuteDSL one), and upstream has not
        fixed both holes itself."""
        return name in findings["oracle_helpers"] and any(duties(findings).values())
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
    how=("Wraps the helper where the oracle looks it up at call time: weight scales checked, "
         "uncalibrated experts repaired; under DP+EP, sender-side dispatch, a global-scale backend "
         "and no EPLB, a13_scale becomes the EP group's max (ep_agreed_gemm1_scale.py)."),
    upstream=("Open as of vLLM 0.34.0; #48355 (0.28.0) agrees the scale only with "
              "--enable-eplb. Proposed as upstream/0001 (GEMM1's scale all-reduced whenever "
              "the all-to-all kernels are used) and upstream/0002 (uncalibrated and missing "
              "expert scales repaired), docs/UPSTREAM.md."),
    remove_when=("findings 'upstream_agrees_gemm1_scale' and 'upstream_repairs_uncalibrated' "
                 "both true on every release still supported (upstream/0001 and 0002 merged: "
                 "the plugin already stands down there), or 'oracle_helpers_take_layer_and_"
                 "a13_scale' false (the plugin then stays inactive on its own)."),
) for name, what in zip(vm.ORACLE_HELPERS, (
    "This helper serves FlashInfer TRT-LLM, CUTLASS (and B12X) in every release of the "
    "design, and CuteDSL in 0.14.x.",
    "This helper serves FlashInfer CuteDSL from vLLM 0.20.0 on.")))
