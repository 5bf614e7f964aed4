# SPDX-License-Identifier: Apache-2.0
"""The slice of the ledger for every design: the fleet check's trigger (the check: fleet.py).
Applied by ``register()`` in every switch state when vLLM imports ``parallel_state``: a rank that
is off takes part too, so that one running the fix knows it is not alone. Its record, probe and
wrapper are here together so that installing it loads this module and ``patching`` only (no
design's folder, not the check itself until the rendezvous: tests/ut/test_import_budget.py)."""

from __future__ import annotations

import functools
import importlib
from typing import Callable

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, Slice

_reporter: Callable[[], object] | None = None  # what this process serves: fleet.Report


def probe() -> dict[str, object]:
    """Does ``init_distributed_environment`` build vLLM's world group by calling the
    module-global ``init_world_group`` (where the fleet check meets every rank)? Reads the
    function's code for the name, as the call site looks it up (v0110 parallel_state.py:1081,
    v0.34.0 :2019)."""
    state = importlib.import_module(vm.PARALLEL_STATE)
    init = getattr(state, "init_distributed_environment", None)
    names = getattr(getattr(init, "__code__", None), "co_names", ())
    return {"world_group_rendezvous": "init_world_group" in names
            and callable(getattr(state, "init_world_group", None))}


def _builds_world_group(findings) -> bool:
    """init_distributed_environment builds the world group through parallel_state's
    init_world_group (every release so far)."""
    return bool(findings["world_group_rendezvous"])


# every MoE design: this is about how vLLM starts a deployment
SLICE = Slice(None, (ModulePatch(
    module=vm.PARALLEL_STATE, attr="init_world_group", build=f"{__name__}:build",
    needed=_builds_world_group,
    why=("Ranks with and without the fix compute NVFP4 MoE layers differently; the check must "
         "meet every rank before weights load, whatever its stage holds. Every worker builds "
         "the world group in init_distributed_environment (v0110 parallel_state.py:1081, "
         "v0.34.0 :2019) through the rendezvous store: written before, visible to all after."),
    how=("Wraps init_world_group: this rank's state goes to the world's store before vLLM's "
         "call, the verdict (fleet.decide) is read after it; the original runs unchanged."),
    upstream="None: vLLM has no plugin hook at distributed initialisation.",
    remove_when=("vLLM gives plugins a hook at distributed initialisation, or finding "
                 "'world_group_rendezvous' is false on every supported release."),
),), ("world_group_rendezvous",), probe)


def build(original):
    """vLLM's ``init_world_group``, with this rank's state written before the rendezvous and the
    fleet's verdict read after it."""
    @functools.wraps(original)
    def init_world_group(*args, **kwargs):
        from vllm_fp4_moe_plugin.patches import fleet  # at the rendezvous, not at install

        fleet.use_reporter(_reporter)
        fleet.before_rendezvous()
        group = original(*args, **kwargs)
        fleet.after_rendezvous()
        return group
    return init_world_group


def install(reporter: Callable[[], object]) -> bool:
    """Apply the fleet check's trigger where the probe finds vLLM's world rendezvous (every
    switch state), with ``reporter`` saying what this process serves; False where it does not
    (the caller says so)."""
    global _reporter
    _reporter = reporter
    findings = probe()
    entries = [p for p in SLICE.patches if p.needed(findings)]
    for p in entries:
        p.apply()
    return bool(entries)
