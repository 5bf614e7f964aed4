# SPDX-License-Identifier: Apache-2.0
"""A small, reversible patch primitive: rebind one module attribute, remember the original.

Mirrors the shape of ArcticInference's ``patching.py`` (one object per replaced symbol, a
double-patch guard), but patches *module attributes*, because that is how vLLM looks up almost
every symbol the plugin replaces (docs/PATCHES.md); ``attr`` may be dotted
(``Config.FusedMoEMethodCls``) for the one vLLM reads from a class attribute. vLLM-free.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

if TYPE_CHECKING:  # the fleet check's entry is applied with nothing else of the plugin loaded
    from vllm_fp4_moe_plugin.base.support import Design

# (module, attribute) -> (original, replacement), for every patch currently applied.
_APPLIED: dict[tuple[str, str], tuple[Any, Any]] = {}


class PatchConflictError(RuntimeError):
    """Re-applying found the symbol replaced since by someone else (another plugin patching it
    too): refused rather than overwrite their replacement."""


Findings = Mapping[str, object]


@dataclass(frozen=True)
class ModulePatch:
    """One replaced vLLM symbol, with its ledger entry. ``build`` names (``"module:function"``,
    imported only when the patch is applied) what turns the original into the replacement (a
    subclass or wrapper of what is really installed); ``needed``, over the findings its slice's
    probe reports, alone decides whether the entry is applied."""

    module: str
    attr: str
    build: str
    needed: Callable[[Findings], bool]
    why: str
    how: str
    upstream: str
    remove_when: str

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    def apply(self) -> bool:
        """Install the replacement. Returns False if it was already installed (idempotent)."""
        key = (self.module, self.attr)
        owner, name = _owner(self.module, self.attr)
        current = getattr(owner, name)
        if key in _APPLIED:
            original, replacement = _APPLIED[key]
            if current is replacement:
                return False
            raise PatchConflictError(
                f"{self.target} was replaced by {current!r} after vllm-fp4-moe-plugin patched it; "
                "another plugin is patching the same symbol."
            )
        builder, _, function = self.build.partition(":")
        replacement = getattr(importlib.import_module(builder), function)(current)
        setattr(owner, name, replacement)
        _APPLIED[key] = (current, replacement)
        return True

    def revert(self) -> bool:
        """Restore the original. Returns False if the patch was not applied."""
        key = (self.module, self.attr)
        if key not in _APPLIED:
            return False
        original, _ = _APPLIED.pop(key)
        setattr(*_owner(self.module, self.attr), original)
        return True

    def original(self) -> Any:
        """The object vLLM had before we patched (or the current one if not patched)."""
        return original_attr(self.module, self.attr)


@dataclass(frozen=True)
class Finding:
    """One fact a probe reads from vLLM: ``read()`` returns it (a falsy value where the code it
    looks for is absent; it may raise only for a vLLM the plugin cannot inspect at all), and
    ``samples`` are the values it can take, which the tests feed every predicate."""

    read: Callable[[], Any]
    samples: tuple = (False, True)


@dataclass(frozen=True)
class Patch:
    """A whole patch in one module of ``patches/``: its ledger entries, the findings its
    predicates read (each read on every design in ``designs``, after the design's own probe),
    and the words the plan adds when one of its entries is applied. The registry picks up every
    module there that assigns ``PATCH``; nothing else names it. The module is vLLM-free and
    torch-free at import (its builders import what they wrap)."""

    designs: tuple[Design, ...]
    entries: tuple[ModulePatch, ...]
    findings: Mapping[str, Finding]
    words: str


@dataclass(frozen=True)
class Slice:
    """One folder of ``patches/``: a design's records (None: every design's, which register()
    applies), its probe (a design's: findings so far -> ``Observation``; else () -> findings)
    and the findings it reports, and the plan's words (``describe``: (findings, needed) ->
    (words, upstream computes right), where they depend on more than ``needed``)."""

    design: Optional[Design]
    patches: tuple[ModulePatch, ...]
    findings: tuple[str, ...]
    probe: Callable[..., Any]
    active: str = ""
    nothing_needed: str = ""
    nothing_needed_is_fixed: bool = False
    describe: Optional[Callable[[Findings, bool], tuple[str, bool]]] = None
    extras: tuple[Patch, ...] = ()  # one-module patches of this design (registry); their
    # entries are in ``patches`` and their findings in ``findings`` too

    def words(self, findings: Findings, needed: bool) -> tuple[str, bool]:
        if self.describe is not None:
            return self.describe(findings, needed)
        return (self.active, False) if needed else (self.nothing_needed,
                                                    self.nothing_needed_is_fixed)


def original_attr(module: str, attr: str) -> Any:
    """What vLLM defines under ``module.attr``, looking through our own patch if applied."""
    if (module, attr) in _APPLIED:
        return _APPLIED[(module, attr)][0]
    return getattr(*_owner(module, attr))


def _owner(module: str, attr: str) -> tuple[Any, str]:
    """(the object holding the attribute, its name): the module, or the class a dotted ``attr``
    names inside it (a class attribute is set on that very class)."""
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def applied_targets() -> list[str]:
    return [f"{m}.{a}" for m, a in _APPLIED]


def same_named_subclass(original: type, mixin: type, module: str, **attrs: Any) -> type:
    """``mixin`` over ``original``, under the original's name and docstring: vLLM looks some of
    these classes up by name (e.g. v0111 layer.py:968), and logs show the familiar name."""
    return type(original.__name__, (mixin, original),
                {"__doc__": original.__doc__, "__module__": module, **attrs})
