# SPDX-License-Identifier: Apache-2.0
"""With upstream's fix in vLLM the plugin stands down, hole by hole.

In each patched world the feature probes must see exactly the fixes applied, and the plugin,
switched on, must keep only the duties upstream still lacks: with every patch, only Llama-4's
router weight (no upstream patch: vllm#43694 is vLLM's own, for its CUTLASS); with some, the plan
names what is left and only its wrappers are in. Where vLLM weights that token once, nothing
with every patch (one INFO line, nothing patched).
"""

import importlib
import logging

from tests.design_gate import one_module_targets
from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.patches import compat, ledger, nvfp4_oracle, router_weight_once

ROUTES = "upstream_zeroes_non_local_routes"
FINDINGS = (*nvfp4_oracle.UPSTREAM_FIXES.values(), ROUTES)


def test_probe_sees_exactly_the_applied_fixes(fixed):
    findings = compat.probe().findings
    assert findings["cutlass_fp4_takes_expert_map"]  # 0.34.0: the routes hole is there to fix
    assert {f for f in FINDINGS if findings[f]} == fixed


def test_plugin_keeps_only_the_duties_upstream_lacks(fixed, fresh_plugin, monkeypatch,
                                                     caplog_plugin):
    helper_before = getattr(importlib.import_module(vm.NVFP4_ORACLE), vm.ORACLE_HELPERS[0])
    cutlass_before = getattr(importlib.import_module(vm.CUTLASS_MOE), vm.CUTLASS_MOE_FP4)
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    state, reason = fresh_plugin.state()
    ours = set(ledger.applied_targets()) - {p.target for p in ledger.EVERY_DESIGN}
    helper = getattr(importlib.import_module(vm.NVFP4_ORACLE), vm.ORACLE_HELPERS[0])
    cutlass = getattr(importlib.import_module(vm.CUTLASS_MOE), vm.CUTLASS_MOE_FP4)
    messages = [(r.levelno, r.getMessage()) for r in caplog_plugin.records
                if r.name.startswith("vllm.fp4_moe_plugin")]
    obs = compat.probe()
    findings = obs.findings
    theirs = one_module_targets(obs)  # Llama-4's router weight: no upstream patch, 0.34.0 keeps it
    assert theirs <= ours
    if fixed == set(FINDINGS) and not theirs:
        assert state == "inactive" and reason.endswith(nvfp4_oracle.FIXED), reason
        assert not ours and helper is helper_before and cutlass is cutlass_before
        assert (logging.INFO, f"vllm-fp4-moe-plugin inactive: {reason}.") in messages
        assert not [m for level, m in messages if level >= logging.WARNING], messages
        return
    left = {d for d, f in nvfp4_oracle.UPSTREAM_FIXES.items() if f not in fixed}
    assert state == "active", reason
    if ours - theirs:  # the folder's own words, then the one-module patches'
        words, _ = nvfp4_oracle.describe(findings, True)
        assert words in reason, reason
    assert (router_weight_once.WORDS in reason) == bool(theirs), reason
    assert nvfp4_oracle.duties(findings) == {d: d in left for d in nvfp4_oracle.UPSTREAM_FIXES}
    scale_target = f"{vm.NVFP4_ORACLE}.{vm.ORACLE_HELPERS[0]}"
    assert (scale_target in ours) == bool(left) and (helper is not helper_before) == bool(left)
    routes_left = ROUTES not in fixed
    assert (f"{vm.CUTLASS_MOE}.{vm.CUTLASS_MOE_FP4}" in ours) == routes_left
    assert (cutlass is not cutlass_before) == routes_left
    assert (nvfp4_oracle.ROUTES in reason) == routes_left
    assert (nvfp4_oracle.CARRY in reason) == ("carry" in left)


def test_plugin_repairs_in_front_of_upstreams_refusal(fixed, refusing, fresh_plugin,
                                                      monkeypatch):
    """0005 off: vLLM refuses uncalibrated expert scales (0002), and the plugin, switched on,
    wraps that refusal with its repair (the helpers' wrapper then repairs nothing); in a world
    without 0002 nothing refuses and no such wrapper is planned."""
    findings = compat.probe().findings
    if "upstream_repairs_uncalibrated" not in fixed:  # no 0002 here: nothing refuses
        assert not findings["upstream_refuses_uncalibrated"]
        assert not nvfp4_oracle.repair_before_refusal(findings)
        return
    assert findings["upstream_refuses_uncalibrated"]
    assert not findings["upstream_repairs_uncalibrated"]
    assert nvfp4_oracle.helper_duties(findings)["repair"] is False
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    assert fresh_plugin.state()[0] == "active"
    assert f"{vm.NVFP4_ORACLE}.{vm.ORACLE_INPUT_SCALE_CHECK}" in ledger.applied_targets()
