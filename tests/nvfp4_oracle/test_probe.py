# SPDX-License-Identifier: Apache-2.0
"""The probe on the nvfp4_oracle release: what it reports, and what the ledger makes of it."""


from tests.design_gate import one_module_targets
from vllm_fp4_moe_plugin.base import vllm_modules
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches import compat, ledger


def test_the_probe_reports_exactly_the_declared_findings():
    obs = compat.probe()
    assert obs.design is Design.NVFP4_ORACLE and obs.patchable, obs
    # Reference check: the keys tests/ut/test_ledger.py checks every predicate against.
    assert set(obs.findings) == set(compat.FINDINGS[obs.design])


def test_the_ledger_wraps_every_helper_the_oracle_has():
    """Every scale-collapsing helper, the weight-only (Marlin) one where it takes the layer (a
    split gate/up), and from 0.32.0 vLLM's CUTLASS NVFP4 MoE under EP (its unzeroed route row:
    the probe runs the function and sees it); then the one-module patches' entries their own
    predicates ask for (tests/patches)."""
    obs = compat.probe()
    plan = ledger.plan(obs)
    helpers = obs.findings["oracle_helpers"]
    assert helpers and set(helpers) <= set(vllm_modules.ORACLE_HELPERS)
    routes = obs.findings["cutlass_fp4_takes_expert_map"]
    marlin = obs.findings["marlin_helper_takes_layer_and_scales"]
    assert not obs.findings["upstream_zeroes_non_local_routes"]
    theirs = one_module_targets(obs)
    assert theirs  # stock 0.34.0: Llama-4's router weight
    assert plan.install and tuple(t for t in plan.patches if t not in theirs) == tuple(
        f"{vllm_modules.NVFP4_ORACLE}.{h}" for h in vllm_modules.ORACLE_HELPERS if h in helpers
    ) + ((f"{vllm_modules.CUTLASS_MOE}.{vllm_modules.CUTLASS_MOE_FP4}",) if routes else ()) + (
        (f"{vllm_modules.NVFP4_ORACLE}.{vllm_modules.ORACLE_MARLIN_HELPER}",) if marlin else ())
    assert theirs <= set(plan.patches)
