# SPDX-License-Identifier: Apache-2.0
"""What every feature probe shares: the observation it returns and the ways it looks at vLLM
(a symbol by module and name, a class's methods, vLLM's own function run on stand-ins). vLLM-free
at import: each helper imports what it is asked to look at."""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass, field
from typing import Optional

from vllm_fp4_moe_plugin.base.support import Design


@dataclass(frozen=True)
class Observation:
    """What the probes saw. ``patchable``: the design is known and has every symbol its
    patches are written against; ``reason``: one line saying what was seen."""

    design: Optional[Design]
    patchable: bool
    reason: str
    findings: dict[str, object] = field(default_factory=dict)


def attr(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def has(module: str, name: str) -> bool:
    try:
        attr(module, name)
    except (ImportError, AttributeError):
        return False
    return True


def missing_methods(module: str, cls_name: str, methods) -> list[str]:
    """The ``methods`` the class no longer has (the ones a patch overrides)."""
    cls = attr(module, cls_name)
    return [m for m in methods if not callable(getattr(cls, m, None))]


def on_cpu(fn, **replaced):
    """vLLM's function ``fn`` over a private copy of its globals with ``replaced`` in it: a probe
    runs vLLM's own code with stand-ins for what it calls (GPU moves, kernels, recorders)."""
    copy = types.FunctionType(fn.__code__, {**fn.__globals__, **replaced}, fn.__name__,
                              fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__  # keyword-only defaults live apart
    return copy


def same(tensor):
    """The identity, standing in for a layout transform (swizzling) a probe does not need."""
    return tensor
