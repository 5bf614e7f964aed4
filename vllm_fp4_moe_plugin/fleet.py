"""The fleet check: a rank that runs the fix never serves next to a rank that does not.

The fix is per process: ranks that disagree (one node without ``VLLM_FP4_MOE_PLUGIN=1``, or
without the plugin, or with another plugin version or vLLM MoE design) compute the NVFP4 MoE
layers with different scales, silently in TP-like layouts. A rank that is off, or has no plugin,
computes as stock vLLM: ranks that all compute as stock agree, whatever they have installed.

When: every rank of every vLLM design builds vLLM's world group
(``parallel_state.init_world_group``) in ``init_distributed_environment``, whatever its pipeline
stage holds and whatever executor started it, before any weight is loaded
(``patches/fleet_rendezvous``). Each process with the plugin writes its :class:`RankState` to
the world's rendezvous store just *before* that group is built and reads the others' just
*after*. Building it connects a gloo group over every rank through the same store, which returns
on no rank until every rank has joined: by then every rank that has the plugin has written, and a
rank that has not written has no plugin (or one without this check). So nobody waits: an off rank
reads and goes on, and a rank with the switch on allows :data:`GRACE_S` for a report still in
flight (possible only where gloo connects lazily, ``TORCH_GLOO_LAZY_INIT=1``). Decision table:
docs/DEPLOYING.md, "The fleet check"; :func:`decide`.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Callable, Mapping, Optional, Sequence

from vllm_fp4_moe_plugin.log import get_logger

logger = get_logger("fleet")

STORE_PREFIX = "vllm_fp4_moe_plugin/fleet/v2/"
# What must be equal on every rank when any rank runs the fix; the other fields say where a
# rank is. ``design`` is compared among ranks with the switch on only (an off rank never
# probes vLLM: it must not import what stock vLLM would not).
AGREED = ("version", "design", "mode")
DOCS = "docs/DEPLOYING.md"
LAUNCHER = "VLLM_FP4_MOE_PLUGIN_LAUNCHER"  # envs.py: set by a deployment's first process
REFUSED = "vllm-fp4-moe-plugin fleet check refused:"  # how every refusal starts (grep for it)
# How long a rank with the switch on waits, after vLLM's world rendezvous, for ranks that have
# not reported. Measured: 0 s in every run (the rendezvous orders the reports before it); the
# grace only covers a gloo world group that connects lazily, whose ranks reach the rendezvous
# within seconds of each other (they have just joined torch's own). Under the 60 s within
# which a mixed fleet must refuse.
GRACE_S = 30.0

# decide()'s verdicts
STOCK = "stock"  # no rank that reported asks for the fix: every rank computes as stock vLLM
AGREED_ON = "agreed"  # every rank reported, all run the fix the same way
MISMATCH = "mismatch"  # ranks that reported run the plugin differently
INCOMPLETE = "incomplete"  # the ranks that reported agree on the fix; some never reported


class FleetMismatchError(RuntimeError):
    """The ranks of the deployment run the plugin differently; no rank with it loads."""


class FleetIncompleteError(RuntimeError):
    """Ranks that run the fix are next to ranks that never reported (no plugin there)."""


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
    def wants_fix(self) -> bool:
        """The operator asked for the fix here: the switch, or the launcher's switch, is on."""
        return self.switch == "1" or self.launcher_on

    @property
    def overridden(self) -> bool:
        """Launched by a process with the switch on, and off by its own environment."""
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
    """The verdict over the ranks that reported (``states``, by rank) in a world of ``world``
    ranks, with the message for a refusal. A rank missing from ``states`` has no plugin: it
    computes as stock, like a rank that is off."""
    if not any(s.wants_fix for s in states.values()):
        return STOCK, None
    missing = [r for r in range(world) if r not in states]
    problem = disagreement(list(states.values()))
    if problem is not None:
        if missing:
            problem += "\n" + _missing_line(missing, world)
        return MISMATCH, problem
    if missing:
        return INCOMPLETE, missing_ranks_message(missing, list(states.values()), world)
    return AGREED_ON, None


def disagreement(states: Sequence[RankState]) -> Optional[str]:
    """None when every rank reports the same version, mode and (switch on) design; else the
    message: each group of ranks with what it runs, then the fix for each field that differs."""
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
                     f"{_switch(overridden[0])}, which wins (Ray keeps a worker's own "
                     "variables).")
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
                   "workers: for Ray, where `ray start` runs on each node."),
}


def _missing_line(missing: Sequence[int], world: int) -> str:
    return (f"  rank(s) {', '.join(map(str, missing))} of the {world}: never reported (no "
            "vllm-fp4-moe-plugin there, or a version without this check)")


def missing_ranks_message(missing: Sequence[int], states: Sequence[RankState],
                          world: int) -> str:
    seen = "; ".join(f"{s.place()}: {s.describe()}" for s in sorted(states, key=lambda s: s.rank))
    return (f"{REFUSED} rank(s) {', '.join(map(str, missing))} of the {world} ranks "
            "of this deployment never reported their plugin state at vLLM's distributed "
            "initialisation, so they compute as stock vLLM while the ranks that reported run "
            "the fix. The plugin is not installed there, not loaded (VLLM_PLUGINS without "
            "fp4_moe), or a version without this check. Fix: install the same "
            "vllm-fp4-moe-plugin on every node and let vLLM load it, or unset "
            f"VLLM_FP4_MOE_PLUGIN everywhere to serve stock vLLM ({DOCS}). Reported: {seen}.")


# -- the rendezvous ---------------------------------------------------------------------

def publish(store, state: RankState) -> None:
    store.set(f"{STORE_PREFIX}{state.rank}", json.dumps(asdict(state)))


def reported(store, world: int) -> dict[int, RankState]:
    """The states written so far, by rank; never waits. Two store round trips when every rank
    has written (the common case), two per rank otherwise."""
    keys = [f"{STORE_PREFIX}{r}" for r in range(world)]
    if store.check(keys):
        return {r: RankState(**json.loads(v)) for r, v in enumerate(_get_all(store, keys))}
    return {r: RankState(**json.loads(store.get(k))) for r, k in enumerate(keys)
            if store.check([k])}


def _get_all(store, keys: list[str]) -> list:
    try:
        return store.multi_get(keys)  # torch 2.4+
    except (AttributeError, RuntimeError):
        return [store.get(k) for k in keys]


def await_reports(store, world: int, grace_s: float) -> dict[int, RankState]:
    """:func:`reported` once every rank has written, or after ``grace_s``."""
    keys = [f"{STORE_PREFIX}{r}" for r in range(world)]
    try:
        store.wait(keys, timedelta(seconds=grace_s))
    except Exception:  # DistStoreError (time is up) or the store is gone: read what is there
        pass
    return reported(store, world)


@dataclass(frozen=True)
class Report:
    """What ``register()`` decided in this process (handed to :func:`before_rendezvous`, so
    that this module does not import the entry point)."""

    version: str
    state: Optional[str]  # the entry point's state: "active", "inactive", "inert", ...
    reason: str
    design: object  # support.Design, or None: the switch is off or the design is unknown


def local_state(rank: int, report: Report) -> RankState:
    """This process's plugin state, as the fleet compares it."""
    mode = {"active": "active", "inactive": "inactive", "pending": "pending",
            "failed": "failed"}.get(report.state or "", "off")
    design = "" if mode == "off" else str(report.design or "unknown")
    return RankState(rank=rank, version=report.version, design=design, mode=mode,
                     switch=os.environ.get("VLLM_FP4_MOE_PLUGIN", "unset"),
                     host=socket.gethostname(), pid=os.getpid(), where=_vllm_ranks(rank),
                     reason=report.reason if mode == "inactive" else "",
                     launcher_on=os.environ.get(LAUNCHER) == "1")


def _vllm_ranks(rank: int) -> str:
    """Where world rank ``rank`` sits in vLLM's layout ("TP 1/2, PP 0/3, DP 0/2"), from the
    current vLLM config (its groups do not exist yet at the rendezvous): vLLM numbers the world
    DP-major, then PP, then (0.2x+) prefill context parallel, then TP
    (parallel_state.initialize_model_parallel). Best effort."""
    try:  # the config the worker set, never a default one (building that one logs)
        found = [getattr(sys.modules.get(m), "_current_vllm_config", None)
                 for m in ("vllm.config.vllm", "vllm.config")]  # 0.12.0+, 0.11.0
        pc = next(c for c in found if c is not None).parallel_config
        tp, pp, dp = pc.tensor_parallel_size, pc.pipeline_parallel_size, pc.data_parallel_size
        stage = tp * getattr(pc, "prefill_context_parallel_size", 1)
    except Exception:
        return ""
    inner = rank % (stage * pp)
    out = [f"TP {inner % tp}/{tp}", f"PP {inner // stage}/{pp}"]
    if dp > 1:
        out.append(f"DP {rank // (stage * pp)}/{dp}")
    return ", ".join(out)


class _Rendezvous:
    """One fleet check per process: :meth:`before` writes this rank's state, :meth:`after`
    reads everyone's and decides (both no-ops without a distributed world of several ranks).
    ``spent_s``: the time both took, vLLM's own rendezvous between them not counted."""

    def __init__(self) -> None:
        self.reporter: Optional[Callable[[], Report]] = None
        self.mine: Optional[RankState] = None
        self.world = 0
        self.store = None
        self.spent_s = 0.0
        self.result: Optional[tuple[str, dict[int, RankState]]] = None

    def before(self) -> None:
        if self.result is not None or self.mine is not None or self.reporter is None:
            return
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
            return
        t0 = time.monotonic()
        mine = local_state(dist.get_rank(), self.reporter())  # on: may refuse (strict, failed)
        try:
            self.store = dist.distributed_c10d._get_default_store()
            self.world = dist.get_world_size()
            publish(self.store, mine)
        except Exception as exc:
            if mine.wants_fix:
                raise
            logger.debug("vllm-fp4-moe-plugin fleet check skipped (off): %r", exc)
            return
        self.mine = mine
        self.spent_s += time.monotonic() - t0

    def after(self) -> None:
        mine, self.mine = self.mine, None
        if mine is None:
            return
        t0 = time.monotonic()
        try:
            states = reported(self.store, self.world)
        except Exception as exc:
            if mine.wants_fix:
                raise
            logger.debug("vllm-fp4-moe-plugin fleet check skipped (off): %r", exc)
            return
        verdict, message = decide(states, self.world)
        if verdict == INCOMPLETE:  # only ranks with the fix on get here: a report in flight?
            states = await_reports(self.store, self.world, GRACE_S)
            verdict, message = decide(states, self.world)
        self.spent_s += time.monotonic() - t0
        if message is not None:
            error = (FleetMismatchError if verdict == MISMATCH else FleetIncompleteError)(
                message)
            logger.error("%s", error)
            raise error
        self.result = (verdict, states)
        if verdict == AGREED_ON:
            logger.info("vllm-fp4-moe-plugin fleet check: all %d ranks run %s (%.1f ms).",
                        self.world, mine.describe().split(" (VLLM_FP4_MOE_PLUGIN")[0],
                        self.spent_s * 1e3)
        else:  # stock everywhere: the plugin stays quiet (at most one line is the off warning)
            logger.debug("vllm-fp4-moe-plugin fleet check: no rank runs the fix (%d of %d "
                         "ranks have the plugin, off); %.1f ms.", len(states), self.world,
                         self.spent_s * 1e3)


_rendezvous = _Rendezvous()


def use_reporter(reporter: Callable[[], Report]) -> None:
    """What register() decided, read at the rendezvous (the entry point's own ``_report``)."""
    _rendezvous.reporter = reporter


def before_rendezvous() -> None:
    """Called just before vLLM builds its world group: write this rank's state."""
    _rendezvous.before()


def after_rendezvous() -> None:
    """Called once vLLM's world group exists: read every rank's state; raise
    :class:`FleetMismatchError` or :class:`FleetIncompleteError` (logged as an ERROR first, so
    each rank's log carries it) where the fleet must not serve."""
    _rendezvous.after()


def checked() -> Optional[tuple[str, dict[int, RankState]]]:
    """(verdict, states by rank) once this process's check has passed; else None."""
    return _rendezvous.result


def _reset_for_tests() -> None:
    reporter = _rendezvous.reporter
    _rendezvous.__init__()
    _rendezvous.reporter = reporter


def warn_if_unchecked() -> None:
    """A WARNING where a process with the switch on builds an NVFP4 MoE layer in a world of
    several ranks whose fleet check never ran (vLLM built its world without
    ``init_world_group``: elastic EP, a design the probe does not know)."""
    if _rendezvous.result is not None:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        logger.warning("vllm-fp4-moe-plugin: the fleet check did not run in this process (vLLM "
                       "built its %d-rank world without init_world_group), so the ranks were "
                       "not compared: make sure every node runs the plugin with "
                       "VLLM_FP4_MOE_PLUGIN=1 (%s).", dist.get_world_size(), DOCS)
