# SPDX-License-Identifier: Apache-2.0
"""Where in vLLM the plugin looks, and when: the module paths and symbol names it probes and
patches, and the one-shot hook that runs a callback right after vLLM first imports one of them.

One place for them, read by ``compat`` (probes), the ledger (``patches/``) and ``register()``
(its trigger modules). vLLM-free: importing this module imports nothing of vLLM.

The hook, because probing and patching need vLLM's MoE modules, whose first import takes
seconds: too slow for ``register()``, run in every vLLM process. vLLM imports them itself
(config/model.py:879-930) before it looks up the classes we replace, so patching then is cheap
and in time.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Callable, Iterable, Optional

QUANTIZATION = _Q = "vllm.model_executor.layers.quantization"
FUSED_MOE = _FM = "vllm.model_executor.layers.fused_moe"

MODELOPT = f"{_Q}.modelopt"
COMPRESSED_TENSORS_MOE = f"{_Q}.compressed_tensors.compressed_tensors_moe"
FLASHINFER_UTILS = f"{_Q}.utils.flashinfer_utils"
FLASHINFER_FP4_MOE = f"{_Q}.utils.flashinfer_fp4_moe"
FUSED_MOE_CONFIG = f"{_FM}.config"
FLASHINFER_CUTLASS_MOE = f"{_FM}.flashinfer_cutlass_moe"
FLASHINFER_CUTLASS_PREPARE_FINALIZE = f"{_FM}.flashinfer_cutlass_prepare_finalize"
FUSED_MOE_MODULAR_METHOD = f"{_FM}.fused_moe_modular_method"  # MODULAR_METHOD design
NVFP4_ORACLE = f"{_FM}.oracle.nvfp4"  # NVFP4_ORACLE design (#31692)
# vLLM's own CUTLASS NVFP4 MoE (--moe-backend cutlass): the function its experts call, by
# module-global name, with the expert map under EP (v0.34.0 FM/experts/cutlass_moe.py:511, 814)
CUTLASS_MOE = f"{_FM}.experts.cutlass_moe"
CUTLASS_MOE_FP4 = "run_cutlass_moe_fp4"
PARALLEL_STATE = "vllm.distributed.parallel_state"  # the world group: fleet check
VLLM_ENVS = "vllm.envs"  # environment_variables: the registry vLLM's Ray copy and checks read

# The compressed-tensors NVFP4 MoE method: its 0.11.x name, then 0.12.0's rename (v0120 CT:195);
# by 0.34.0 in a file of its own, under the quantization package (v0.34.0 CT/...moe/__init__.py).
CT_NVFP4_CLASS_NAMES = ("CompressedTensorsW4A4MoeMethod", "CompressedTensorsW4A4Nvfp4MoEMethod")
CT_NVFP4_MOE_FILE = "compressed_tensors/compressed_tensors_moe/compressed_tensors_moe_w4a4_nvfp4.py"
ROUTED_EXPERTS_FILE = "routed_experts.py"  # under FUSED_MOE: RoutedExperts.weight_loader
# ModelOpt's NVFP4 MoE method (every release read, 0.11.0-0.34.0).
MODELOPT_NVFP4_CLASS_NAME = "ModelOptNvFp4FusedMoE"
# The NVFP4_ORACLE design's scale-collapsing helpers, as the oracle imports them (the first is in
# every release of the design, the CuteDSL one from 0.20.0), and the parameters the patch reads.
ORACLE_HELPERS = ("prepare_nvfp4_moe_layer_for_fi_or_cutlass",
                  "prepare_nvfp4_moe_layer_for_flashinfer_cutedsl")
ORACLE_HELPER_PARAMS = ("layer", "a13_scale")
# The weight-only (W4A16) helper the oracle calls where the GPU has no FP4 compute (Hopper) or
# --moe-backend marlin: no activation scale, GEMM2's weight scale alone carries a split gate/up.
ORACLE_MARLIN_HELPER = "prepare_nvfp4_moe_layer_for_marlin"
ORACLE_MARLIN_HELPER_PARAMS = ("layer", "w13_scale_2", "w2_scale_2")
# Where a vLLM with upstream/0002 refuses uncalibrated expert activation scales, before any
# helper runs; the plugin's repair goes in front of it (``(layer, a13_scale, a2_scale)``).
ORACLE_INPUT_SCALE_CHECK = "check_nvfp4_moe_input_scales"

# The tensors by which an NVFP4 MoE layer is recognised when it is built, whatever the design:
# the first weight global scale each format's create_weights registers (ModelOpt,
# compressed-tensors), in every release read (0.11.0, 0.12.0, 0.32.0, 0.34.0).
NVFP4_MOE_MARKERS = ("w13_weight_scale_2", "w13_weight_global_scale")

# Modules whose first import triggers probe + patch; vLLM imports them while verifying a
# ModelConfig's quantization method, before any quant method is constructed. From 0.14.0 both
# quant methods import the NVFP4 oracle (the module the patch changes) at their top.
TRIGGER_MODULES = (MODELOPT, COMPRESSED_TENSORS_MOE, NVFP4_ORACLE)


# The import hook: run a callback right after vLLM first imports a module.


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
