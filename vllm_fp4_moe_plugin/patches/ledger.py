# SPDX-License-Identifier: Apache-2.0
"""The patch ledger: every vLLM symbol this plugin replaces, and why. A folder (or a one-module
patch) holds a whole patch: its records (why, how, upstream, when to delete; vllm-ascend's ledger
format) with a ``needed(findings)`` predicate over what its probe reports, which alone decides
what is applied (:func:`plan`); the probe; the replacements. ``registry.SLICES`` gathers them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches import plugin_env
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, applied_targets
from vllm_fp4_moe_plugin.patches.registry import DESIGNS, SLICES

# Entries for every design (design None), applied by register() itself: plugin_env (switch
# on), fleet_rendezvous (on, off or unset).
EVERY_DESIGN = tuple(p for s in SLICES if s.design is None for p in s.patches)
# once each: a one-module patch's entries are in the slice of every design it names
LEDGER: tuple[ModulePatch, ...] = tuple(dict.fromkeys(p for s in SLICES for p in s.patches))


@dataclass(frozen=True)
class Plan:
    """What register() does on the installed vLLM: apply ``patches`` (ledger targets), or stay
    inactive for ``reason``: fine when upstream already does what the patches would
    (``upstream_fixed``); otherwise the operator asked for the fix and does not get it."""

    install: bool
    reason: str
    design: Optional[Design] = None
    findings: dict[str, object] = field(default_factory=dict)
    patches: tuple[str, ...] = ()
    upstream_fixed: bool = False


def entries_for_design(design: Optional[Design]) -> tuple[ModulePatch, ...]:
    """The ledger entries of ``design``; None: those for every design."""
    if design is None:
        return EVERY_DESIGN
    return DESIGNS[design].patches if design in DESIGNS else ()


def list_plugin_env() -> list[str]:
    """Apply the every-design entries the probe asks for (register(), switch on): returns the
    targets newly replaced. Raises :class:`PatchInstallError` naming the target on failure,
    with nothing of them left applied; the MoE fix does not depend on them."""
    findings = plugin_env.probe()
    wanted = [p.target for p in plugin_env.SLICE.patches if p.needed(findings)]
    return apply_targets(None, wanted) if wanted else []


def plan(observation=None) -> Plan:
    """The ledger's decision for ``observation`` (default: probe the installed vLLM now)."""
    if observation is None:
        from vllm_fp4_moe_plugin.patches import compat

        observation = compat.probe()
    obs = observation
    if obs.design is None or not obs.patchable:
        return Plan(False, obs.reason, obs.design, dict(obs.findings))
    needed = tuple(p.target for p in entries_for_design(obs.design) if p.needed(obs.findings))
    part = DESIGNS[obs.design]
    theirs = {e.target for p in part.extras for e in p.entries}
    if not any(t not in theirs for t in needed):
        words, fixed = part.words(obs.findings, False)
        if not fixed:  # a vLLM the design cannot tell (a partial backport, moved helpers):
            # no patch at all, one-module ones included, and the design's words say why
            return Plan(False, f"{obs.design.label}: {words}", obs.design, dict(obs.findings))
    words, fixed = _words(part, obs.findings, needed)
    return Plan(bool(needed), f"{obs.design.label}: {words}", obs.design, dict(obs.findings),
                needed, upstream_fixed=fixed)


def _words(part, findings, needed: tuple[str, ...]) -> tuple[str, bool]:
    """The design's words for its own entries, then each one-module patch's that is applied."""
    extra = [p for p in part.extras if any(e.target in needed for e in p.entries)]
    theirs = {e.target for p in part.extras for e in p.entries}
    own = any(t not in theirs for t in needed)
    if extra and not own:
        return "; ".join(p.words for p in extra), False
    words, fixed = part.words(findings, own)
    return "; ".join([words] + [p.words for p in extra]), fixed and not extra


def apply_all() -> list[str]:
    """Apply what :func:`plan` asks for on the installed vLLM; returns the targets newly
    replaced (empty if already done, or if the plan is to stay inactive)."""
    decision = plan()
    if not decision.install:
        return []
    return apply_targets(decision.design, decision.patches)


class PatchInstallError(RuntimeError):
    """A patch the probe asked for could not be applied. None of the requested patches is left
    in place; the process must not serve (with the plugin asked for, serving unpatched would be
    the silent wrong answer this plugin exists to prevent)."""

    def __init__(self, target: str, cause: BaseException | str) -> None:
        self.target = target
        why = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(
            f"vllm-fp4-moe-plugin could not patch {target} ({why}); no patch is applied and "
            "this process refuses to serve. Set VLLM_FP4_MOE_PLUGIN=0 to run stock vLLM, or "
            "report this with `vllm-fp4-moe doctor` output.")


def apply_targets(design: Optional[Design], targets) -> list[str]:
    """Apply the ledger entries of ``design`` named in ``targets``, all or none; returns the
    targets newly replaced. On any failure every requested entry (also from an earlier call)
    and every every-design entry is reverted, and :class:`PatchInstallError` names the target."""
    wanted = set(targets)
    entries = [p for p in entries_for_design(design) if p.target in wanted]
    unknown = sorted(wanted - {p.target for p in entries})
    if unknown:
        raise PatchInstallError(unknown[0], f"no ledger entry of the {design or 'every-design'} "
                                "slice")
    newly: list[str] = []
    for p in entries:
        try:
            if p.apply():
                newly.append(p.target)
        except BaseException as exc:  # nothing of the plugin stays: the every-design entries
            _revert_quietly(entries + list(EVERY_DESIGN))  # go too (the process will not serve)
            raise PatchInstallError(p.target, exc) from exc
    return newly


def _revert_quietly(entries) -> None:
    for p in reversed(list(entries)):
        try:
            p.revert()
        except Exception:  # keep reverting the others; the caller raises the first failure
            pass


def revert_all() -> list[str]:
    """Revert every applied entry; one that fails does not stop the others (then raises)."""
    reverted, failed = [], []
    for p in reversed(LEDGER):
        try:
            if p.revert():
                reverted.append(p.target)
        except Exception as exc:
            failed.append((p.target, exc))
    if failed:
        target, error = failed[0]
        raise RuntimeError(f"could not restore vLLM's {target}: {type(error).__name__}: "
                           f"{error}") from error
    return reverted


__all__ = ["EVERY_DESIGN", "LEDGER", "ModulePatch", "PatchInstallError", "Plan", "apply_all",
           "apply_targets", "applied_targets", "entries_for_design",
           "list_plugin_env", "plan", "revert_all"]
