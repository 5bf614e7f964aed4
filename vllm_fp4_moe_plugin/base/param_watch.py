# SPDX-License-Identifier: Apache-2.0
"""A read-only watch on parameter registration: the one load-time event that every vLLM design
and every plugin state (on, off, unset) shares. vLLM's NVFP4 MoE quant methods register their
tensors in ``create_weights`` and ``process_weights_after_loading``; a torch registration hook
sees both without replacing anything of vLLM. It is installed once torch is imported (importing
torch here would cost ~2 s in a process that may never load a model).
"""

from __future__ import annotations

from typing import Any, Callable

from vllm_fp4_moe_plugin.base import vllm_modules

_TORCH_MODULE = "torch.nn.modules.module"


class ParamWatch:
    """Calls ``on_parameter(module, name, param)`` for every parameter registered, from
    :meth:`install` until :meth:`stop` or :meth:`remove` (all idempotent). Inside a hook, stop:
    torch iterates over its hooks while calling them ("OrderedDict mutated during iteration")."""

    def __init__(self, on_parameter: Callable) -> None:
        self._on_parameter = on_parameter
        self._handle: Any = None
        self._pending: Any = None  # the import hook while torch is not imported yet
        self._stopped = False

    def _call(self, module, name: str, param) -> None:
        if not self._stopped:
            self._on_parameter(module, name, param)

    def stop(self) -> None:
        """No more calls; safe inside a hook (the handle stays until :meth:`remove`)."""
        self._stopped = True

    def install(self) -> None:
        self._stopped = False
        if self._handle is None and self._pending is None:
            self._pending = vllm_modules.run_after_first_import((_TORCH_MODULE,), self._now)

    def _now(self) -> None:
        self._pending = None
        if self._handle is None:
            from torch.nn.modules.module import register_module_parameter_registration_hook

            self._handle = register_module_parameter_registration_hook(self._call)

    def remove(self) -> None:
        """Stop and unregister (not from inside a hook: :meth:`stop` there)."""
        self._stopped = True
        vllm_modules.cancel(self._pending)
        self._pending = None
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
