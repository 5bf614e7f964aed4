# SPDX-License-Identifier: Apache-2.0
"""With upstream's fix in vLLM the plugin stands down, hole by hole.

In each patched world the feature probes must see exactly the fixes applied, and the plugin,
switched on, must keep only the duties upstream still lacks: none with both patches (one INFO
line, nothing patched), the EP agreement alone or the repair alone with one of them.
"""

import importlib
import logging

from vllm_fp4_moe_plugin import compat, patches
from vllm_fp4_moe_plugin import vllm_modules as vm
from vllm_fp4_moe_plugin.patches import nvfp4_oracle


def test_probe_sees_exactly_the_applied_fixes(fixed):
    findings = compat.probe().findings
    assert {f for f in nvfp4_oracle.UPSTREAM_FIXES.values() if findings[f]} == fixed


def test_plugin_keeps_only_the_duties_upstream_lacks(fixed, fresh_plugin, monkeypatch,
                                                     caplog_plugin):
    helper_before = getattr(importlib.import_module(vm.NVFP4_ORACLE), vm.ORACLE_HELPERS[0])
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    state, reason = fresh_plugin.state()
    ours = set(patches.applied_targets()) - {p.target for p in patches.EVERY_DESIGN}
    helper = getattr(importlib.import_module(vm.NVFP4_ORACLE), vm.ORACLE_HELPERS[0])
    messages = [(r.levelno, r.getMessage()) for r in caplog_plugin.records
                if r.name.startswith("vllm.fp4_moe_plugin")]
    if len(fixed) == 2:
        assert state == "inactive" and reason.endswith(nvfp4_oracle.FIXED), reason
        assert not ours and helper is helper_before
        assert (logging.INFO, f"vllm-fp4-moe-plugin inactive: {reason}.") in messages
        assert not [m for level, m in messages if level >= logging.WARNING], messages
        return
    left = next(d for d, f in nvfp4_oracle.UPSTREAM_FIXES.items() if f not in fixed)
    assert state == "active" and reason.endswith(nvfp4_oracle.PARTLY[left]), reason
    assert helper is not helper_before and f"{vm.NVFP4_ORACLE}.{vm.ORACLE_HELPERS[0]}" in ours
    assert nvfp4_oracle.duties(compat.probe().findings) == {
        d: d == left for d in nvfp4_oracle.UPSTREAM_FIXES}
