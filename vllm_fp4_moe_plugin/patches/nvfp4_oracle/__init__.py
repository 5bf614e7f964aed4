# SPDX-License-Identifier: Apache-2.0
"""The NVFP4_ORACLE design's slice of the ledger (vLLM 0.14.0-0.34.0): one wrapper on each
scale-collapsing helper the oracle has, with two duties (the EP-agreed GEMM1 scale, the repair of
uncalibrated expert scales), each dropped where the probe sees upstream do it; and, from 0.32.0,
one on vLLM's own CUTLASS NVFP4 MoE under EP (routes to other ranks' experts add zero). vLLM-free.
The folder: this record, its probe (``probe.py``), the wrappers (``ep_agreed_gemm1_scale.py``,
``non_local_routes.py``, ``weight_only_gate_up.py``: the weight-only helper's split gate/up).
"""

from __future__ import annotations

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.nvfp4_oracle import probe
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, Slice

ACTIVE = ("compressed-tensors collapses GEMM1 input scales to each EP rank's local max, which "
          "DP+EP dispatch mixes across ranks")
NOTHING_NEEDED = "the oracle has none of the scale-collapsing helpers this plugin wraps"

# Each duty of the wrapper and the finding that sees vLLM do it itself (upstream/0001, 0002); the
# plan's words when vLLM does one (keyed by the duty left) or both.
UPSTREAM_FIXES = {"agree": "upstream_agrees_gemm1_scale",
                  "repair": "upstream_repairs_uncalibrated",
                  "carry": "upstream_carries_gate_up"}
PARTLY = {"agree": "upstream repairs uncalibrated expert scales; " + ACTIVE,
          "repair": ("upstream gives every EP rank the same GEMM1 scale; stock leaves uncalibrated "
                     "or missing expert activation scales as loaded")}
FIXED = ("upstream already computes right: it gives every EP rank the same GEMM1 activation "
         "scale and repairs uncalibrated expert activation scales itself")


ROUTES = ("vLLM's own CUTLASS NVFP4 MoE under EP reads an unzeroed workspace row for routes to "
          "other ranks' experts")
SCALES_FIXED = ("upstream gives every EP rank the same GEMM1 scale and repairs uncalibrated expert "
                "scales")


def duties(findings) -> dict[str, bool]:
    """The scale wrapper's duties this vLLM still needs (``agree``, ``repair``)."""
    return {duty: not findings.get(finding) for duty, finding in UPSTREAM_FIXES.items()}


def helper_duties(findings) -> dict[str, bool]:
    """:func:`duties` as the helpers' wrapper does them: where vLLM refuses uncalibrated
    expert scales before its helpers (upstream/0002), the repair runs in front of that refusal
    instead (:func:`repair_before_refusal`)."""
    out = duties(findings)
    out["repair"] = out["repair"] and not findings.get("upstream_refuses_uncalibrated")
    return out


def repair_before_refusal(findings) -> bool:
    """vLLM refuses uncalibrated expert activation scales (upstream/0002) without repairing
    them itself (0005 absent or off): the plugin's repair goes in front of the refusal."""
    return bool(findings.get("upstream_refuses_uncalibrated")) and duties(findings)["repair"]


def routes_needed(findings) -> bool:
    """vLLM's CUTLASS NVFP4 MoE takes the expert map (0.32.0+) and still reads the unzeroed
    workspace row for non-local routes (upstream/0003 not in)."""
    return bool(findings.get("cutlass_fp4_takes_expert_map")) and not findings.get(
        "upstream_zeroes_non_local_routes")


CARRY = ("vLLM reads the up half of GEMM1 with the gate's weight global scale where a "
         "checkpoint gives each its own")


def describe(findings, needed: bool) -> tuple[str, bool]:
    """The plan's words, and whether standing down means upstream computes right."""
    left = [d for d, todo in duties(findings).items() if todo and d != "carry"]
    if needed and duties(findings)["carry"]:
        words, _ = describe({**findings, "upstream_carries_gate_up": True}, needed)
        return words + "; " + CARRY, False
    if needed:
        scales = SCALES_FIXED if not left else ACTIVE if len(left) == 2 else PARTLY[left[0]]
        return scales + ("; " + ROUTES if routes_needed(findings) else ""), False
    # NOTHING_NEEDED is not a fix: the helpers moved, whether upstream fixed the hole is unknown
    return (FIXED, True) if not left else (NOTHING_NEEDED, False)


def marlin_needed(findings) -> bool:
    """The oracle calls the weight-only helper with the layer and GEMM2's weight scale, and
    upstream does not carry a split gate/up itself (upstream/0004 not in)."""
    return bool(findings.get("marlin_helper_takes_layer_and_scales")) and duties(findings)["carry"]


def _helper_needed(name: str):
    def needed(findings) -> bool:
        """The oracle has this helper (0.20.0+ for the CuteDSL one), and upstream has not
        fixed both holes itself."""
        return name in findings["oracle_helpers"] and any(helper_duties(findings).values())
    return needed


PATCHES = tuple(ModulePatch(
    module=vm.NVFP4_ORACLE, attr=name, build=f"{__name__}.ep_agreed_gemm1_scale:build",
    needed=_helper_needed(name),
    why=("vLLM 0.14.0+ collapses GEMM1's activation scales to the max over the experts a rank "
         "loaded, only its local ones for compressed-tensors (v0.34.0 FM/routed_experts.py:"
         "764-771): under DP+EP a sender-side dispatcher quantizes with the sender's max while "
         "the owner's g1_alphas fold in its own, GEMM1 off by their ratio. Every release also "
         "reads a split checkpoint's up half with the gate's weight scale. " + what),
    how=("Wraps the helper where the oracle looks it up at call time: weight scales checked, "
         "uncalibrated experts repaired, a split gate/up factor carried by GEMM2's scales; under "
         "DP+EP and sender-side dispatch, a13_scale becomes the EP group's max."),
    upstream=("Open as of vLLM 0.34.0 (#48355 agrees the scale only with --enable-eplb; gate/up: "
              "#54974 open); proposed as upstream/0001 (compressed-tensors loads every expert's "
              "input scales, as ModelOpt does since #26135), 0002 and 0004 (docs/UPSTREAM.md)."),
    remove_when=("findings 'upstream_agrees_gemm1_scale', 'upstream_repairs_uncalibrated' and "
                 "'upstream_carries_gate_up' true on every supported release (the plugin stands "
                 "down where they are), or 'oracle_helpers_take_layer_and_a13_scale' false."),
) for name, what in zip(vm.ORACLE_HELPERS, (
    "This helper serves FlashInfer TRT-LLM, CUTLASS (and B12X) in every release of the "
    "design, and CuteDSL in 0.14.x.",
    "This helper serves FlashInfer CuteDSL from vLLM 0.20.0 on."))) + (ModulePatch(
    module=vm.NVFP4_ORACLE, attr=vm.ORACLE_INPUT_SCALE_CHECK,
    build=f"{__name__}.ep_agreed_gemm1_scale:build_check", needed=repair_before_refusal,
    why=("A vLLM with upstream/0002 refuses a checkpoint whose expert activation scales are NaN, "
         "inf, non-positive or missing, in check_nvfp4_moe_input_scales, before the helpers "
         "above run; the plugin's repair in their wrapper would come too late, and the model "
         "would not load where the plugin serves it on stock."),
    how=("Wraps the check where the conversion looks it up at call time: the plugin's repair "
         "(scale_rule: each value judged alone, a calibrated expert never touched) runs first, "
         "then vLLM's check sees calibrated scales; the helpers' wrapper then repairs nothing."),
    upstream=("Proposed as upstream/0002 (the refusal, vLLM's default) and 0005 (the same repair "
              "in vLLM, opt-in: VLLM_NVFP4_MOE_REPAIR_INPUT_SCALES=1, where the plugin stands "
              "down); neither is in vLLM 0.34.0, where this entry is never applied."),
    remove_when=("finding 'upstream_repairs_uncalibrated' true wherever "
                 "'upstream_refuses_uncalibrated' is (vLLM repairing by default), or "
                 "'upstream_refuses_uncalibrated' false on every supported release."),
), ModulePatch(
    module=vm.CUTLASS_MOE, attr=vm.CUTLASS_MOE_FP4,
    build=f"{__name__}.non_local_routes:build", needed=routes_needed,
    why=("vLLM 0.32.0+ runs its own CUTLASS NVFP4 MoE (--moe-backend cutlass) under EP with an "
         "expert map. Its route sort points every route to another rank's expert at row "
         "expert_offsets[E] of GEMM2's output, which GEMM2 never writes, on the promise that the "
         "output starts zeroed (csrc moe_data.cu compute_arg_sorts); run_cutlass_moe_fp4 takes it "
         "from workspace13, which held GEMM1's output and earlier layers' data (v0.34.0 "
         "FM/experts/cutlass_moe.py:643-645, FM/modular_kernel.py:1266-1273): each such route "
         "adds its router weight times that row."),
    how=("Wraps run_cutlass_moe_fp4 where CutlassExpertsFp4.apply looks it up at call time: "
         "with an expert map, zeroes the one workspace13 row non-local routes read (no sync) "
         "and gives them weight 0 (non_local_routes.py; cost: benchmarks/route_fix.py)."),
    upstream=("Open as of vLLM 0.34.0; proposed as upstream/0003 (docs/UPSTREAM.md): zero the "
              "row of GEMM2's output non-local routes read, under an expert map, in the NVFP4 "
              "and MXFP4 functions (vLLM's FP8 path zeroed its whole output for the same "
              "contract, #20167)."),
    remove_when=("finding 'upstream_zeroes_non_local_routes' true on every supported release "
                 "from 0.32.0 (the plugin already stands down where it is), or "
                 "'cutlass_fp4_takes_expert_map' false."),
),) + (ModulePatch(
    module=vm.NVFP4_ORACLE, attr=vm.ORACLE_MARLIN_HELPER,
    build=f"{__name__}.weight_only_gate_up:build", needed=marlin_needed,
    why=("Where the GPU has no FP4 compute (Hopper) or --moe-backend marlin, the oracle prepares "
         "NVFP4 MoE layers for Marlin's weight-only kernel, outside the helpers above, with the "
         "gate's weight global scale for both halves (v0.34.0 FM/oracle/nvfp4.py:447-465): a "
         "split gate/up checkpoint's up half is off by the ratio there too."),
    how=("Wraps the weight-only helper where the oracle looks it up at call time: each expert's "
         "gate/up factor divides GEMM2's weight scale (weight_only_gate_up.py; no activation "
         "scale: the kernel quantizes nothing)."),
    upstream=("Open as of vLLM 0.34.0 (#54974); proposed as upstream/0004 (docs/UPSTREAM.md), "
              "which folds before any backend's helper."),
    remove_when=("finding 'upstream_carries_gate_up' true on every supported release, or "
                 "'marlin_helper_takes_layer_and_scales' false."),
),)
SLICE = Slice(Design.NVFP4_ORACLE, PATCHES, probe.FINDINGS, probe.observe, describe=describe)
