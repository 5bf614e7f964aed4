"""The slice of the ledger for every design: the fleet check's trigger (fleet.py) in vLLM's
distributed initialisation. vLLM-free until applied. ``register()`` applies it in every process,
the switch on, off or unset, when vLLM imports ``parallel_state``: a rank that is off takes part
too, so that a rank running the fix knows it is alone, but never waits and never refuses unless
a rank that reported runs the fix.
"""

from __future__ import annotations

import functools

from vllm_fp4_moe_plugin import fleet
from vllm_fp4_moe_plugin import vllm_modules as vm
from vllm_fp4_moe_plugin.patching import ModulePatch

DESIGN = None  # every MoE design: this is about how vLLM starts a deployment, not about MoE


def _build_init_world_group(original):
    @functools.wraps(original)
    def init_world_group(*args, **kwargs):
        fleet.before_rendezvous()
        group = original(*args, **kwargs)
        fleet.after_rendezvous()
        return group
    return init_world_group


def _builds_world_group(findings) -> bool:
    """vLLM builds its world group by calling ``parallel_state.init_world_group`` from
    ``init_distributed_environment`` (every release so far: compat.world_group_rendezvous)."""
    return bool(findings["world_group_rendezvous"])


LEDGER: tuple[ModulePatch, ...] = (ModulePatch(
    module=vm.PARALLEL_STATE, attr="init_world_group", build=_build_init_world_group,
    design=DESIGN, needed=_builds_world_group,
    why=("Ranks that run the fix and ranks that do not compute the NVFP4 MoE layers with "
         "different scales. The fleet check must meet every rank, before any weight loads, "
         "whatever its pipeline stage holds (a stage of dense layers builds no NVFP4 MoE "
         "layer), in every executor; vLLM has no plugin hook there. Every worker builds the "
         "world group in init_distributed_environment (v0110 parallel_state.py:1081, v0.12.0 "
         ":1239, v0.14.0 :1253, v0.20.0 :1457, v0.34.0 :2019): its gloo group connects every "
         "rank through the rendezvous store, so a state written before it is visible to all "
         "after it."),
    how=("Wraps init_world_group: this rank's state goes to the world's store before vLLM's "
         "call, the verdict (fleet.decide) is read after it. The original runs unchanged; "
         "init_distributed_environment looks the name up at call time."),
    upstream="None: vLLM has no plugin hook at distributed initialisation.",
    remove_when=("vLLM gives plugins a hook at distributed initialisation (then use it), or "
                 "compat finding 'world_group_rendezvous' is false on every supported release "
                 "(then find the new rendezvous)."),
),)
