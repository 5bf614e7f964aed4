"""A small, reversible patch primitive: rebind one module attribute, remember the original.

Mirrors the shape of ArcticInference's ``patching.py`` (one object per replaced symbol, a
double-patch guard, one log line per replacement), but patches *module attributes* because that
is how vLLM 0.11.0 looks up every symbol we replace (see docs/PATCHES.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable

# (module, attribute) -> (original, replacement), for every patch currently applied.
_APPLIED: dict[tuple[str, str], tuple[Any, Any]] = {}


class PatchConflictError(RuntimeError):
    """Someone else replaced a symbol we want to patch; refusing to stack on top of it."""


@dataclass(frozen=True)
class ModulePatch:
    """One replaced vLLM symbol, with its ledger entry.

    ``build`` receives the original object and returns the replacement, so replacements can
    subclass or wrap what is really installed.
    """

    module: str
    attr: str
    build: Callable[[Any], Any]
    why: str
    how: str
    upstream: str
    remove_when: str
    designs: tuple[str, ...] = ("0.11.0",)  # compat.DESIGN_* this entry belongs to

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}"

    def apply(self) -> bool:
        """Install the replacement. Returns False if it was already installed (idempotent)."""
        key = (self.module, self.attr)
        mod = importlib.import_module(self.module)
        current = getattr(mod, self.attr)
        if key in _APPLIED:
            original, replacement = _APPLIED[key]
            if current is replacement:
                return False
            raise PatchConflictError(
                f"{self.target} was replaced by {current!r} after vllm-fp4-moe-plugin patched it; "
                "another plugin is patching the same symbol."
            )
        replacement = self.build(current)
        setattr(mod, self.attr, replacement)
        _APPLIED[key] = (current, replacement)
        return True

    def revert(self) -> bool:
        """Restore the original. Returns False if the patch was not applied."""
        key = (self.module, self.attr)
        if key not in _APPLIED:
            return False
        original, _ = _APPLIED.pop(key)
        setattr(importlib.import_module(self.module), self.attr, original)
        return True

    def original(self) -> Any:
        """The object vLLM had before we patched (or the current one if not patched)."""
        return original_attr(self.module, self.attr)


def original_attr(module: str, attr: str) -> Any:
    """What vLLM defines under ``module.attr``, looking through our own patch if applied."""
    if (module, attr) in _APPLIED:
        return _APPLIED[(module, attr)][0]
    return getattr(importlib.import_module(module), attr)


def applied_targets() -> list[str]:
    return [f"{m}.{a}" for m, a in _APPLIED]
