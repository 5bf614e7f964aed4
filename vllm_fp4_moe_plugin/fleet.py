"""The fleet check: every rank of a deployment runs the plugin the same way, or none loads.

The fix is per process: ranks that disagree (one node without ``VLLM_FP4_MOE_PLUGIN=1``, another
plugin version or vLLM MoE design) compute the NVFP4 MoE layers with different scales, silently
in TP-like layouts. So every process that builds an NVFP4 MoE layer, whatever its switch, reports
its :class:`RankState` when the first such layer registers its tensors, waits for every rank's,
and all compare (docs/DEPLOYING.md). Through the world's rendezvous store, not a gloo collective:
a collective is matched by order, and a rank that is off or has no plugin cannot be relied on to
issue it at the same point in vLLM's own sequence; the store has no order, and it tells which
ranks never wrote.
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Optional, Sequence

from vllm_fp4_moe_plugin import envs
from vllm_fp4_moe_plugin.log import get_logger

logger = get_logger("fleet")

STORE_PREFIX = "vllm_fp4_moe_plugin/fleet/v1/"
# What must be equal on every rank; the other fields only say where a rank is.
AGREED = ("version", "design", "mode")
DOCS = "docs/DEPLOYING.md"
LAUNCHER = "VLLM_FP4_MOE_PLUGIN_LAUNCHER"  # envs.py: set by a deployment's first process


class FleetMismatchError(RuntimeError):
    """The ranks of the deployment run the plugin differently; no rank loads."""


class FleetTimeout(RuntimeError):
    """Some ranks never reported their plugin state (not installed there, or crashed)."""


@dataclass(frozen=True)
class RankState:
    rank: int
    version: str
    design: str  # the vLLM MoE design the probe saw, or "unknown"
    mode: str  # "active", "inactive", "off" or "pending"
    switch: str  # VLLM_FP4_MOE_PLUGIN as set ("1", "0") or "unset"
    host: str = ""
    pid: int = 0
    where: str = ""  # vLLM's parallel ranks, e.g. "TP 0/2, DP 1/2"
    reason: str = ""
    launcher_on: bool = False  # the process that started this one has the switch on

    def key(self) -> tuple:
        return tuple(getattr(self, f) for f in AGREED)

    @property
    def overridden(self) -> bool:
        """Launched by a process with the switch on, and off by its own environment."""
        return self.launcher_on and self.switch != "1"

    def describe(self) -> str:
        switch = _switch(self)
        why = f": {self.reason}" if self.mode == "inactive" and self.reason else ""
        return (f"plugin {self.version}, vLLM MoE design {self.design}, {self.mode}{why} "
                f"({switch})")

    def place(self) -> str:
        bits = [b for b in (self.host and f"host {self.host}", self.pid and f"pid {self.pid}",
                            self.where) if b]
        return f"rank {self.rank}" + (f" ({', '.join(bits)})" if bits else "")


def disagreement(states: Sequence[RankState]) -> Optional[str]:
    """None when every rank reports the same version, design and mode; else the message: each
    group of ranks with what it runs, then the fix for each field that differs."""
    groups: dict[tuple, list[RankState]] = {}
    for s in sorted(states, key=lambda s: s.rank):
        groups.setdefault(s.key(), []).append(s)
    overridden = [s for s in states if s.overridden]
    if len(groups) <= 1 and not overridden:
        return None
    lines = [f"vllm-fp4-moe-plugin: the {len(states)} ranks of this deployment run the plugin "
             "differently, so they would compute the NVFP4 MoE layers differently; no rank "
             "loads the model."]
    for members in groups.values():
        places = "; ".join(m.place() for m in members)
        lines.append(f"  {members[0].describe()}: {places}")
    if overridden:
        lines.append(f"  {_ranks(overridden)}: started by a process with VLLM_FP4_MOE_PLUGIN=1 "
                     "(where `vllm serve` runs), but the worker's own environment has "
                     f"{_switch(overridden[0])}, which wins (Ray keeps a worker's own "
                     "variables).")
    differs = [f for i, f in enumerate(AGREED) if len({k[i] for k in groups}) > 1]
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
                   "workers: for Ray, where `ray start` runs on each node."),
}


def missing_ranks_message(missing: Sequence[int], states: Sequence[RankState], world: int,
                          timeout_s: float) -> str:
    seen = "; ".join(f"{s.place()}: {s.describe()}" for s in sorted(states, key=lambda s: s.rank))
    return (f"vllm-fp4-moe-plugin: rank(s) {', '.join(map(str, missing))} of the {world} ranks "
            f"of this deployment never reported their plugin state within {timeout_s:g} s "
            "(VLLM_FP4_MOE_PLUGIN_TIMEOUT_S). The plugin is not installed there (or is a "
            "version without this check), or that rank crashed or is stuck before building its "
            "first NVFP4 MoE layer; check that rank's log. Install the same "
            f"vllm-fp4-moe-plugin on every node ({DOCS}). Reported: {seen or 'none'}.")


def exchange(store, rank: int, world: int, state: RankState,
             timeout_s: float) -> list[RankState]:
    """Write this rank's state to ``store``, wait for every rank's, return all of them;
    :class:`FleetTimeout` names the ranks that did not write within ``timeout_s``."""
    store.set(f"{STORE_PREFIX}{rank}", json.dumps(asdict(state)))
    keys = [f"{STORE_PREFIX}{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:  # DistStoreError (timeout) or the store is gone (rank 0 died)
        present = [r for r in range(world) if _has_key(store, keys[r])]
        missing = [r for r in range(world) if r not in present]
        states = [_read(store, keys[r]) for r in present]
        raise FleetTimeout(missing_ranks_message(missing or ["?"], states, world, timeout_s)
                           + f" ({type(exc).__name__}: {str(exc).strip().splitlines()[0]})"
                           ) from exc
    return [_read(store, k) for k in keys]


def _has_key(store, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except Exception:
        return False


def _read(store, key: str) -> RankState:
    return RankState(**json.loads(store.get(key)))


@dataclass(frozen=True)
class Report:
    """What ``register()`` decided in this process (handed to :func:`check_now`, so that this
    module does not import the entry point)."""

    version: str
    state: Optional[str]  # the entry point's state: "active", "inactive", "inert", ...
    reason: str
    design: object  # support.Design, or None: the switch is off or the design is unknown


def local_state(rank: int, report: Report) -> RankState:
    """This process's plugin state, as the fleet compares it."""
    mode = {"active": "active", "inactive": "inactive", "pending": "pending"}.get(
        report.state or "", "off")
    design = report.design
    if design is None and mode == "off":  # the switch is off: the probe has not run here
        from vllm_fp4_moe_plugin import compat

        design = compat.probe().design
    return RankState(rank=rank, version=report.version,
                     design=str(design) if design is not None else "unknown", mode=mode,
                     switch=os.environ.get("VLLM_FP4_MOE_PLUGIN", "unset"),
                     host=socket.gethostname(), pid=os.getpid(), where=_vllm_ranks(),
                     reason=report.reason if mode == "inactive" else "",
                     launcher_on=os.environ.get(LAUNCHER) == "1")


def _vllm_ranks() -> str:
    """vLLM's coordinates of this rank ("TP 1/2, PP 0/1, DP 0/2"), best effort."""
    try:
        from vllm.distributed import parallel_state as ps
    except Exception:
        return ""
    out = []
    for name, getter in (("TP", "get_tp_group"), ("PP", "get_pp_group"),
                         ("DP", "get_dp_group")):
        try:
            group = getattr(ps, getter)()
            out.append(f"{name} {group.rank_in_group}/{group.world_size}")
        except Exception:
            continue
    return ", ".join(out)


_checked: Optional[list[RankState]] = None


def check_now(reporter: Callable[[], Report],
              timeout_s: Optional[float] = None) -> Optional[list[RankState]]:
    """Run the fleet check once per process (``reporter``: what ``register()`` decided, at this
    moment); None where there is no world of several ranks. A :class:`FleetMismatchError` or
    :class:`FleetTimeout` is logged as an ERROR first, so each rank's log carries it."""
    global _checked
    if _checked is not None:
        return _checked
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return None
    if timeout_s is None:
        timeout_s = envs.VLLM_FP4_MOE_PLUGIN_TIMEOUT_S
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    try:
        states = exchange(store, rank, world, local_state(rank, reporter()), timeout_s)
        problem = disagreement(states)
        if problem is not None:
            raise FleetMismatchError(problem)
    except (FleetMismatchError, FleetTimeout) as exc:
        logger.error("%s", exc)
        raise
    _checked = states
    mine = states[rank]
    logger.info("vllm-fp4-moe-plugin fleet check: all %d ranks run %s.", world,
                mine.describe().split(" (VLLM_FP4_MOE_PLUGIN")[0])
    return states


def _reset_for_tests() -> None:
    global _checked
    _checked = None
