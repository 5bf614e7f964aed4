# SPDX-License-Identifier: Apache-2.0
"""The slice of the ledger for every design: the fleet check's trigger (fleet.py). Applied by
``register()`` in every switch state when vLLM imports ``parallel_state``: a rank that is off
takes part too, so that one running the fix knows it is not alone."""

from __future__ import annotations

import functools

from vllm_fp4_moe_plugin import fleet
from vllm_fp4_moe_plugin import vllm_modules as vm
from vllm_fp4_moe_plugin.patching import ModulePatch

DESIGN = None  # every MoE design: this is about how vLLM starts a deployment


def _build_init_world_group(original):
    @functools.wraps(original)
    def init_world_group(*args, **kwargs):
        fleet.before_rendezvous()
        group = original(*args, **kwargs)
        fleet.after_rendezvous()
        return group
    return init_world_group


def _builds_world_group(findings) -> bool:
    """init_distributed_environment builds the world group through parallel_state's
    init_world_group (every release so far: compat.probe_world_group_rendezvous)."""
    return bool(findings["world_group_rendezvous"])


LEDGER: tuple[ModulePatch, ...] = (ModulePatch(
    module=vm.PARALLEL_STATE, attr="init_world_group", build=_build_init_world_group,
    design=DESIGN, needed=_builds_world_group,
    why=("Ranks that run the fix and ranks that do not compute NVFP4 MoE layers differently. "
         "The check must meet every rank before weights load, whatever its stage holds, in every "
         "executor; vLLM has no plugin hook there. Every worker builds the world group in "
         "init_distributed_environment (v0110 parallel_state.py:1081, v0.12.0 :1239, v0.14.0 "
         ":1253, v0.20.0 :1457, v0.34.0 :2019), whose gloo group joins every rank through the "
         "rendezvous store: a state written before it is visible to all after it."),
    how=("Wraps init_world_group: this rank's state goes to the world's store before vLLM's "
         "call, the verdict (fleet.decide) is read after it; the original runs unchanged."),
    upstream="None: vLLM has no plugin hook at distributed initialisation.",
    remove_when=("vLLM gives plugins a hook at distributed initialisation, or compat finding "
                 "'world_group_rendezvous' is false on every supported release."),
),)
