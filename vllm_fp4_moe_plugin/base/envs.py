# SPDX-License-Identifier: Apache-2.0
"""Environment variables of the plugin, parsed in one place with errors that name the fix.

Parsers read through module ``__getattr__`` (as vllm-spyre's ``envs.py``), so ``envs.X`` always
reflects the current environment (tests set and unset it)."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    VLLM_FP4_MOE_PLUGIN: bool = False
    VLLM_FP4_MOE_PLUGIN_CHECK: str = "warn"
    VLLM_FP4_MOE_DEBUG: bool = False
    VLLM_FP4_MOE_PLUGIN_TIMEOUT_S: float = 600.0
    VLLM_FP4_MOE_PLUGIN_LAUNCHER: bool = False


class EnvVarError(ValueError):
    """A plugin variable holds a value it does not accept; the message names the allowed ones."""


def _choice(name: str, allowed: dict[str, Any], default: str) -> Callable[[], Any]:
    """Exactly one of ``allowed``: `` 1`` or ``STRICT`` is an error, so what runs is as written."""
    def parse() -> Any:
        raw = os.environ.get(name)
        if raw is None:
            return allowed[default]
        if raw not in allowed:
            shown = ", ".join(repr(k) for k in allowed)
            near = raw.strip().lower()
            hint = (f"; did you mean {near!r}? Write it exactly, without spaces, in lowercase"
                    if near in allowed else "")
            raise EnvVarError(f"{name}={raw!r} is not a valid value; allowed values are {shown} "
                              f"(unset means {default!r}){hint}.")
        return allowed[raw]

    return parse


def _seconds(name: str, default: float) -> Callable[[], float]:
    """Positive seconds in digits (``600``, ``90.5``); ``abc``, ``0``, ``-5``, ``inf``, ``nan``
    and ``1e3`` are errors, so a wait is never zero, endless or a guess."""
    def parse() -> float:
        raw = os.environ.get(name)
        if raw is None:
            return default
        if re.fullmatch(r"[0-9]+(\.[0-9]+)?", raw) is None or float(raw) <= 0:
            raise EnvVarError(
                f"{name}={raw!r} is not a valid value; write a positive number of seconds in "
                f"digits, e.g. {name}={default:g} (unset means {default:g}).")
        return float(raw)

    return parse


# The wait at each layer's load-time scale agreement: torch's default NCCL timeout, which vLLM's
# own first collectives after loading wait too, so the plugin is never the first to give up.
DEFAULT_TIMEOUT_S = 600.0

environment_variables: dict[str, Callable[[], Any]] = {
    # Opt-in: "1" installs the fixes in every vLLM process; unset or "0" leaves vLLM untouched
    # (unset warns once if a layer needs the fix). Anything else is an error: no silent typo.
    "VLLM_FP4_MOE_PLUGIN": _choice("VLLM_FP4_MOE_PLUGIN", {"0": False, "1": True}, "0"),
    # consistency.py's load-time check: off, warn (a summary line), strict (raise at a bad layer).
    "VLLM_FP4_MOE_PLUGIN_CHECK": _choice(
        "VLLM_FP4_MOE_PLUGIN_CHECK", {"off": "off", "warn": "warn", "strict": "strict"}, "warn"),
    # CLI only: "1" shows an internal error's traceback (as --debug); else one line, exit 70.
    "VLLM_FP4_MOE_DEBUG": _choice("VLLM_FP4_MOE_DEBUG", {"0": False, "1": True}, "0"),
    "VLLM_FP4_MOE_PLUGIN_TIMEOUT_S": _seconds("VLLM_FP4_MOE_PLUGIN_TIMEOUT_S", DEFAULT_TIMEOUT_S),
    # Not for operators: register() sets it in a deployment's first process with the switch on,
    # so a worker whose own environment turns the switch off knows it was launched to be on.
    "VLLM_FP4_MOE_PLUGIN_LAUNCHER": _choice("VLLM_FP4_MOE_PLUGIN_LAUNCHER",
                                            {"0": False, "1": True}, "0")}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
