# SPDX-License-Identifier: Apache-2.0
"""The probe on the nvfp4_oracle release: what it reports, and what the ledger makes of it."""


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
    split gate/up), from 0.32.0 vLLM's CUTLASS NVFP4 MoE under EP (its unzeroed route row:
    the probe runs the function and sees it), and the modular kernel's experts call (the router
    weight on the input counted once)."""
    obs = compat.probe()
    plan = ledger.plan(obs)
    helpers = obs.findings["oracle_helpers"]
    assert helpers and set(helpers) <= set(vllm_modules.ORACLE_HELPERS)
    routes = obs.findings["cutlass_fp4_takes_expert_map"]
    marlin = obs.findings["marlin_helper_takes_layer_and_scales"]
    kernel = obs.findings["modular_kernel_class"]
    assert kernel and obs.findings["nvfp4_experts_weight_again"]  # stock 0.34.0
    assert not obs.findings["upstream_zeroes_non_local_routes"]
    assert plan.install and plan.patches == tuple(
        f"{vllm_modules.NVFP4_ORACLE}.{h}" for h in vllm_modules.ORACLE_HELPERS if h in helpers
    ) + ((f"{vllm_modules.CUTLASS_MOE}.{vllm_modules.CUTLASS_MOE_FP4}",) if routes else ()) + (
        f"{vllm_modules.MODULAR_KERNEL}.{kernel}._fused_experts",) + (
        (f"{vllm_modules.NVFP4_ORACLE}.{vllm_modules.ORACLE_MARLIN_HELPER}",) if marlin else ())
