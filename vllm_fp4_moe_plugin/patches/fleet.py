# SPDX-License-Identifier: Apache-2.0
"""The fleet check: a rank that runs the fix never serves next to a rank that does not.

Ranks that disagree compute the NVFP4 MoE layers with different scales, silently in TP-like
layouts; a rank that is off, or has no plugin, computes as stock. A process with the plugin writes
its :class:`RankState` to the world's store just before vLLM builds its world group
(``patches/fleet_rendezvous``) and reads everyone's just after: building it connects every rank
through that store, so a rank that has not written has no plugin. Nobody waits, except a rank
running the fix next to a missing one (:data:`GRACE_S`). See :func:`decide`, docs/DEPLOYING.md."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence

from vllm_fp4_moe_plugin.base.log import get_logger

logger = get_logger("fleet")

STORE_PREFIX = "vllm_fp4_moe_plugin/fleet/v2/"
# Compared when any rank runs the fix; the design only among ranks that are on (an off rank
# does not probe vLLM: it must import nothing stock vLLM would not).
AGREED = ("version", "design", "mode")
DOCS = "docs/DEPLOYING.md"
LAUNCHER = "VLLM_FP4_MOE_PLUGIN_LAUNCHER"  # envs.py: set by a deployment's first process
REFUSED = "vllm-fp4-moe-plugin fleet check refused:"  # how every refusal starts
# How long a rank running the fix waits for ranks missing after the rendezvous (0 s measured, but
# gloo may connect lazily: TORCH_GLOO_LAZY_INIT); under the 60 s a mixed fleet must refuse within.
GRACE_S = 30.0
STOCK, AGREED_ON, MISMATCH, INCOMPLETE = "stock", "agreed", "mismatch", "incomplete"


class FleetMismatchError(RuntimeError):
    """Some ranks run the fix and others do not (or run another version or design)."""


class FleetIncompleteError(RuntimeError):
    """Ranks that run the fix are next to ranks without the plugin."""


@dataclass(frozen=True)
class RankState:
    rank: int
    version: str
    design: str  # the vLLM MoE design the probe saw; "" where the switch is off (not probed)
    mode: str  # "active", "inactive", "pending", "failed" (switch on) or "off"
    switch: str  # VLLM_FP4_MOE_PLUGIN as set ("1", "0") or "unset"
    host: str = ""
    pid: int = 0
    where: str = ""  # vLLM's parallel ranks, e.g. "TP 0/2, DP 1/2"
    reason: str = ""
    launcher_on: bool = False  # the process that started this one has the switch on

    def key(self) -> tuple:
        return (self.version, self.design if self.mode != "off" else "", self.mode)

    @property
    def wants_fix(self) -> bool:  # asked for here: by the switch, or the launcher's
        return self.switch == "1" or self.launcher_on

    @property
    def overridden(self) -> bool:  # launched to be on, off by its own environment
        return self.launcher_on and self.switch != "1"

    def describe(self) -> str:
        switch = _switch(self)
        if self.mode == "off":
            return f"plugin {self.version}, off ({switch})"
        why = f": {self.reason}" if self.mode == "inactive" and self.reason else ""
        return (f"plugin {self.version}, vLLM MoE design {self.design or 'unknown'}, "
                f"{self.mode}{why} ({switch})")

    def place(self) -> str:
        bits = [b for b in (self.host and f"host {self.host}", self.pid and f"pid {self.pid}",
                            self.where) if b]
        return f"rank {self.rank}" + (f" ({', '.join(bits)})" if bits else "")


def decide(states: Mapping[int, RankState], world: int) -> tuple[str, Optional[str]]:
    """(verdict, refusal message) over the ranks that reported; a missing one computes as stock."""
    if not any(s.wants_fix for s in states.values()):
        return STOCK, None
    missing = ", ".join(str(r) for r in range(world) if r not in states)
    problem = disagreement(list(states.values()))
    if problem is not None:
        return MISMATCH, problem + (f"\n  rank(s) {missing} of the {world}: never reported (no "
                                    "plugin there, or one without this check)" if missing else "")
    if missing:
        seen = "; ".join(f"{s.place()}: {s.describe()}" for _, s in sorted(states.items()))
        return INCOMPLETE, (
            f"{REFUSED} rank(s) {missing} of the {world} ranks of this deployment never "
            "reported their plugin state at vLLM's distributed initialisation, so they compute "
            "as stock vLLM while the ranks that reported run the fix. The plugin is not "
            "installed there, not loaded (VLLM_PLUGINS without fp4_moe), or a version without "
            "this check. Fix: install the same vllm-fp4-moe-plugin on every node and let vLLM "
            f"load it, or unset VLLM_FP4_MOE_PLUGIN everywhere to serve stock vLLM ({DOCS}). "
            f"Reported: {seen}.")
    return AGREED_ON, None


def disagreement(states: Sequence[RankState]) -> Optional[str]:
    """None when all report the same version, mode and (switch on) design; else the message."""
    groups: dict[tuple, list[RankState]] = {}
    for s in sorted(states, key=lambda s: s.rank):
        groups.setdefault(s.key(), []).append(s)
    overridden = [s for s in states if s.overridden]
    if len(groups) <= 1 and not overridden:
        return None
    lines = [f"{REFUSED} the {len(states)} ranks of this deployment that have the "
             "plugin run it differently, so they would compute the NVFP4 MoE layers "
             "differently; no rank with the plugin loads the model."]
    for members in groups.values():
        places = "; ".join(m.place() for m in members)
        lines.append(f"  {members[0].describe()}: {places}")
    if overridden:
        lines.append(f"  {_ranks(overridden)}: started by a process with VLLM_FP4_MOE_PLUGIN=1 "
                     "(where `vllm serve` runs), but the worker's own environment has "
                     f"{_switch(overridden[0])}, which wins (Ray keeps a worker's own variables).")
    on = [k for k in groups if k[2] != "off"]
    differs = [f for i, f in enumerate(AGREED)
               if len({k[i] for k in (on if f == "design" else groups)}) > 1]
    fixes = [_FIXES[f] for f in differs] + ([_FIXES["overridden"]] if overridden else [])
    lines.append("Fix: " + " ".join(dict.fromkeys(fixes)) + f" ({DOCS})")
    return "\n".join(lines)


def _ranks(states: Sequence[RankState]) -> str:
    ranks = [str(s.rank) for s in sorted(states, key=lambda s: s.rank)]
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(ranks)


def _switch(state: RankState) -> str:
    return ("VLLM_FP4_MOE_PLUGIN unset" if state.switch == "unset"
            else f"VLLM_FP4_MOE_PLUGIN={state.switch}")


_FIXES = {
    "mode": ("Set VLLM_FP4_MOE_PLUGIN to the same value (1 to serve with the fix) for every "
             "process, on every node: where `vllm serve` runs and, for Ray, where `ray start` "
             "runs; a rank that is inactive says why above."),
    "version": "Install the same vllm-fp4-moe-plugin version on every node.",
    "design": "Install the same vLLM release on every node.",
    "overridden": ("Unset VLLM_FP4_MOE_PLUGIN (or set it to 1) in the environment of those "
                   "workers: for Ray, where `ray start` runs on each node.")}


# -- the rendezvous ---------------------------------------------------------------------

def _key(rank: int) -> str:
    return f"{STORE_PREFIX}{rank}"


def reported(store, world: int) -> dict[int, RankState]:
    """The states written so far, by rank; never waits (two round trips when all are in)."""
    keys = [_key(r) for r in range(world)]
    if store.check(keys):
        try:
            values = store.multi_get(keys)  # torch 2.4+
        except (AttributeError, RuntimeError):
            values = [store.get(k) for k in keys]
        return {r: RankState(**json.loads(v)) for r, v in enumerate(values)}
    return {r: RankState(**json.loads(store.get(k))) for r, k in enumerate(keys)
            if store.check([k])}


@dataclass(frozen=True)
class Report:
    """What ``register()`` decided in this process (this module does not import it)."""

    version: str
    state: Optional[str]  # the entry point's state: "active", "inactive", "inert", ...
    reason: str
    design: object  # support.Design, or None: the switch is off or the design is unknown


def local_state(rank: int, report: Report) -> RankState:
    mode = report.state if report.state in ("active", "inactive", "pending", "failed") else "off"
    return RankState(rank=rank, version=report.version,
                     design="" if mode == "off" else str(report.design or "unknown"),
                     mode=mode, switch=os.environ.get("VLLM_FP4_MOE_PLUGIN", "unset"),
                     host=socket.gethostname(), pid=os.getpid(), where=_vllm_ranks(rank),
                     reason=report.reason if mode == "inactive" else "",
                     launcher_on=os.environ.get(LAUNCHER) == "1")


def _vllm_ranks(rank: int) -> str:
    """"TP 1/2, PP 0/3, DP 0/2" from the worker's config, numbered as initialize_model_parallel
    does (DP-major, then PP, prefill context parallel, TP)."""
    try:
        found = [getattr(sys.modules.get(m), "_current_vllm_config", None)
                 for m in ("vllm.config.vllm", "vllm.config")]  # 0.12.0+, 0.11.0
        pc = next(c for c in found if c is not None).parallel_config
        tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
        stage = tp * getattr(pc, "prefill_context_parallel_size", 1)
    except Exception:
        return ""
    inner = rank % (stage * pp)
    dp_part = f", DP {rank // (stage * pp)}/{dp}" if dp > 1 else ""
    return f"TP {inner % tp}/{tp}, PP {inner // stage}/{pp}{dp_part}"


_reporter: Optional[Callable[[], Report]] = None
_pending: Optional[tuple] = None  # (store, world, this rank's state, seconds spent so far)
_result: Optional[tuple[str, dict[int, RankState]]] = None
spent_s = 0.0  # what the check took in this process, vLLM's rendezvous not counted


def use_reporter(reporter: Callable[[], Report]) -> None:
    global _reporter
    _reporter = reporter


def before_rendezvous() -> None:
    """Just before vLLM builds its world group: write this rank's state (once per process)."""
    global _pending
    import torch.distributed as dist

    if (_result is not None or _pending is not None or _reporter is None
            or not (dist.is_available() and dist.is_initialized())
            or dist.get_world_size() <= 1):
        return
    t0 = time.monotonic()
    mine = local_state(dist.get_rank(), _reporter())  # on: may refuse (strict, failed)
    store = dist.distributed_c10d._get_default_store()  # vLLM's own init just used it
    store.set(_key(mine.rank), json.dumps(asdict(mine)))
    _pending = (store, dist.get_world_size(), mine, time.monotonic() - t0)


def after_rendezvous() -> None:
    """Once vLLM's world group exists: read every rank's state, decide, log and raise a refusal."""
    global _pending, _result, spent_s
    if _pending is None:
        return
    (store, world, mine, spent_s), _pending = _pending, None
    t0 = time.monotonic()
    states = reported(store, world)
    verdict, message = decide(states, world)
    if verdict == INCOMPLETE:  # only ranks that run the fix get here: a report in flight?
        try:
            store.wait([_key(r) for r in range(world)], timedelta(seconds=GRACE_S))
        except Exception:  # the grace is over (or the store gone): decide on what is there
            pass
        states = reported(store, world)
        verdict, message = decide(states, world)
    spent_s += time.monotonic() - t0
    if message is not None:
        error = (FleetMismatchError if verdict == MISMATCH else FleetIncompleteError)(message)
        logger.error("%s", error)
        raise error
    _result = (verdict, states)
    if verdict == AGREED_ON:
        logger.info("vllm-fp4-moe-plugin fleet check: all %d ranks run %s (%.1f ms).", world,
                    mine.describe().split(" (VLLM_FP4_MOE_PLUGIN")[0], spent_s * 1e3)
    else:  # stock everywhere: quiet (the off warning is the plugin's one line)
        logger.debug("vllm-fp4-moe-plugin fleet check: no rank runs the fix (%d of %d ranks "
                     "have the plugin, off); %.1f ms.", len(states), world, spent_s * 1e3)


def checked() -> Optional[tuple[str, dict[int, RankState]]]:
    """(verdict, states by rank) once this process's check has passed; else None."""
    return _result


def warn_if_unchecked() -> None:
    """Switch on, an NVFP4 MoE layer, several ranks, no check (elastic EP builds no world group)."""
    import torch.distributed as dist

    if _result is None and dist.is_initialized() and dist.get_world_size() > 1:
        logger.warning("vllm-fp4-moe-plugin: the fleet check did not run in this process (vLLM "
                       "built its %d-rank world without init_world_group), so the ranks were "
                       "not compared: make sure every node runs the plugin with "
                       "VLLM_FP4_MOE_PLUGIN=1 (%s).", dist.get_world_size(), DOCS)


def _reset_for_tests() -> None:
    global _pending, _result, spent_s
    _pending, _result, spent_s = None, None, 0.0
