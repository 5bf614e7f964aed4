# SPDX-License-Identifier: Apache-2.0
"""The switch reaches Ray workers: on this release vLLM copies to Ray workers and Ray
data-parallel engine cores only the variables its registry lists (``vllm/ray/ray_env.py``),
and register() lists the plugin's."""

import pytest

OWN = {"VLLM_FP4_MOE_PLUGIN", "VLLM_FP4_MOE_PLUGIN_CHECK", "VLLM_FP4_MOE_PLUGIN_TIMEOUT_S"}


def _copied():
    """What this release's Ray executor hands each worker's update_environment_variables:
    the names get_env_vars_to_copy returns that are set in the driver's environment."""
    import os

    from vllm.ray.ray_env import get_env_vars_to_copy

    return {n for n in get_env_vars_to_copy(destination="workers") if n in os.environ}


def test_release_copies_the_plugins_variables_only_once_register_lists_them(fresh_plugin,
                                                                            monkeypatch):
    from vllm_fp4_moe_plugin.patches import ledger

    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "strict")
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_TIMEOUT_S", "900")
    assert not OWN & _copied()  # stock: a Ray worker on another node would start without them
    fresh_plugin.register()
    assert OWN <= _copied()
    assert "vllm.envs.environment_variables" in ledger.applied_targets()
    import vllm.envs as vllm_envs

    assert vllm_envs.VLLM_FP4_MOE_PLUGIN == "1"  # read as vLLM reads its own: the raw string
    fresh_plugin._reset_for_tests()  # reverted with the rest
    assert not OWN & _copied()


@pytest.mark.parametrize("value", [None, "0"])
def test_off_lists_nothing(fresh_plugin, monkeypatch, value):
    """Off leaves vLLM untouched, its registry included."""
    import vllm.envs as vllm_envs

    before = vllm_envs.environment_variables
    if value is not None:
        monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", value)
    fresh_plugin.register()
    assert vllm_envs.environment_variables is before
