# SPDX-License-Identifier: Apache-2.0
"""Feature probes of the installed vLLM: :func:`probe` names the MoE design from what the code
*is* (never ``vllm.__version__``: a source build or a backport would lie), then returns what that
design's folder's probe (``patches/<design>/probe.py``) observed. It decides nothing
(docs/ROOT-CAUSE.md §10)."""

from __future__ import annotations

import importlib.util
import inspect
from typing import Optional

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.probing import Observation, attr, has
from vllm_fp4_moe_plugin.patches.registry import DESIGNS, SLICES

# What each design's probe reports: the detector's findings, then its folder's (tests check the
# real probe and every ledger predicate against these). None: the slices for every design.
_COMMON = ("nvfp4_oracle",)
_PRE_ORACLE = _COMMON + ("init_prepare_finalize", "modular_method", "tp_fix_present",
                         "modelopt_dp_fix_present")
FINDINGS: dict[Optional[Design], tuple[str, ...]] = {
    None: tuple(f for s in SLICES if s.design is None for f in s.findings),
    **{d: (_COMMON if d is Design.NVFP4_ORACLE else _PRE_ORACLE) + s.findings
       for d, s in DESIGNS.items()}}


def experts_take_use_dp() -> bool:
    """P1: 0.11.1's TP fix (#27223) added ``FlashInferExperts(use_dp=...)``, which sizes the
    output for what prepare hands over (v0111 flashinfer_cutlass_moe.py:59)."""
    return (has(vm.FLASHINFER_CUTLASS_MOE, "FlashInferExperts") and "use_dp" in
            inspect.signature(attr(vm.FLASHINFER_CUTLASS_MOE,
                                   "FlashInferExperts").__init__).parameters)


def builds_modular_kernel() -> bool:
    """Both pre-oracle designs build a modular kernel only for an EP group of several ranks, in
    its device communicator's prepare_communication_buffer_for_model (v0110 parallel_state.py:252,
    base_device_communicator.py:274; v0120 :360, :276); one rank runs FlashInfer's direct call."""
    from vllm.distributed import get_ep_group

    return get_ep_group().world_size > 1


def _nvfp4_oracle_present() -> bool:
    """0.14.0+ (PR #31692): ``fused_moe/oracle/nvfp4.py``. Checked without importing it."""
    parent = vm.NVFP4_ORACLE.rsplit(".", 1)[0]
    return (importlib.util.find_spec(parent) is not None
            and importlib.util.find_spec(vm.NVFP4_ORACLE) is not None)


def probe() -> Observation:
    """Never raises: any surprise becomes ``patchable=False`` with the reason."""
    try:
        return _probe()
    except Exception as exc:  # a vLLM we cannot even inspect is not one we patch
        return Observation(None, False, f"could not inspect vLLM's MoE internals ({exc!r})")


def _probe() -> Observation:
    """The design's own probe, then the findings of its one-module patches."""
    obs = _design_probe()
    if obs.design is None or not DESIGNS[obs.design].extras:
        return obs
    findings = dict(obs.findings)
    for patch in DESIGNS[obs.design].extras:
        findings.update({name: f.read() for name, f in patch.findings.items()})
    return Observation(obs.design, obs.patchable, obs.reason, findings)


def _design_probe() -> Observation:
    findings: dict[str, object] = {}
    # From 0.28.0 fused_moe/layer.py no longer defines FusedMoE: look for the oracle first.
    findings["nvfp4_oracle"] = _nvfp4_oracle_present()
    if findings["nvfp4_oracle"]:
        return DESIGNS[Design.NVFP4_ORACLE].probe(findings)
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase

    # P3: 0.11.0 builds modular kernels through FusedMoEMethodBase.init_prepare_finalize;
    # 0.11.1 moved that to FusedMoE.maybe_init_modular_kernel (v0111 layer.py:622).
    has_init_pf = hasattr(FusedMoEMethodBase, "init_prepare_finalize")
    has_maybe_init = hasattr(FusedMoE, "maybe_init_modular_kernel")
    findings["init_prepare_finalize"] = has_init_pf and not has_maybe_init
    findings["modular_method"] = (has_maybe_init and not has_init_pf
                                  and has(vm.FUSED_MOE_MODULAR_METHOD, "FusedMoEModularMethod"))
    findings["tp_fix_present"] = experts_take_use_dp()
    # P2: 0.11.1's ModelOpt DP fix (v0111 flashinfer_utils.py:292).
    findings["modelopt_dp_fix_present"] = has(vm.FLASHINFER_UTILS,
                                              "is_flashinfer_supporting_global_sf")
    for design in (Design.INIT_PREPARE_FINALIZE, Design.MODULAR_METHOD):
        if findings[design.value]:
            return DESIGNS[design].probe(findings)
    return Observation(None, False, "vLLM's MoE internals are none of the designs this plugin "
                       "knows (" + ", ".join(d.label for d in Design) + "; see "
                       "docs/SUPPORT.md)", findings)
