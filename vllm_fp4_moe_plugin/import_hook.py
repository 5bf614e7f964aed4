# SPDX-License-Identifier: Apache-2.0
"""Run a callback right after vLLM first imports one of a few modules.

Probing and patching need vLLM's MoE modules, whose first import takes seconds: too slow for
``register()``, run in every vLLM process. vLLM imports them itself (config/model.py:879-930)
before it looks up the classes we replace, so patching then is cheap and in time.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Iterable, Optional


class _CallbackLoader(importlib.abc.Loader):
    def __init__(self, inner, done: Callable[[], None]) -> None:
        self._inner, self._done = inner, done

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:
        self._inner.exec_module(module)
        self._done()

    def __getattr__(self, name):  # get_source, is_package, ... for tools that ask
        return getattr(self._inner, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, modules: Iterable[str], callback: Callable[[], None]) -> None:
        self.modules, self.callback, self.fired = frozenset(modules), callback, False

    def find_spec(self, fullname, path, target=None):
        if self.fired or fullname not in self.modules:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None:
            spec.loader = _CallbackLoader(spec.loader, self.fire)
        return spec

    def fire(self) -> None:
        if self.fired:
            return
        self.fired = True
        _drop(self)
        self.callback()


class _Refuse(importlib.abc.MetaPathFinder):
    """Raise ``error`` on every later import of ``modules``: after a failed install, a retried
    import of the module dropped from ``sys.modules`` must not quietly get it unpatched."""

    def __init__(self, modules: Iterable[str], error: BaseException) -> None:
        self.modules, self.error = frozenset(modules), error

    def find_spec(self, fullname, path, target=None):
        if fullname in self.modules:
            raise self.error
        return None


_hooks: list[_AfterImport] = []
_refusal: _Refuse | None = None


def refuse(modules: Iterable[str], error: BaseException) -> None:
    """From now on, importing any of ``modules`` (not yet imported) raises ``error``."""
    global _refusal
    _remove_refusal()
    _refusal = _Refuse(modules, error)
    sys.meta_path.insert(0, _refusal)


def _remove_refusal() -> None:
    global _refusal
    if _refusal is not None and _refusal in sys.meta_path:
        sys.meta_path.remove(_refusal)
    _refusal = None


def run_after_first_import(modules: Iterable[str],
                           callback: Callable[[], None]) -> Optional[_AfterImport]:
    """Call ``callback`` once: now if any of ``modules`` is imported, else right after the first of
    them is (several may wait). Returns the pending hook, or None if the callback already ran."""
    modules = tuple(modules)
    if any(m in sys.modules for m in modules):
        callback()
        return None
    if any(h.modules & set(modules) for h in _hooks):  # each would search the other: recursion
        raise ValueError(f"an import hook already waits for one of {modules}: give it one "
                         "callback that does both")
    hook = _AfterImport(modules, callback)
    _hooks.append(hook)
    sys.meta_path.insert(0, hook)
    return hook


def cancel(hook: Optional[_AfterImport]) -> None:
    """Drop one pending hook (None, or one that already fired: nothing to do)."""
    if hook is not None:
        _drop(hook)


def _drop(hook: _AfterImport) -> None:
    if hook in sys.meta_path:
        sys.meta_path.remove(hook)
    if hook in _hooks:
        _hooks.remove(hook)


def remove() -> None:
    """Drop every pending hook (and, for tests, a refusal left by a failed install)."""
    for hook in list(_hooks):
        _drop(hook)
    _remove_refusal()
