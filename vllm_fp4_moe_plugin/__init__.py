# SPDX-License-Identifier: Apache-2.0
"""vllm-fp4-moe-plugin: correct NVFP4 MoE activation scales on stock vLLM (0.11.0 to 0.34.0).

vLLM calls :func:`register` in every process it starts via the ``vllm.general_plugins`` entry
point ``fp4_moe``. It is cheap (no vLLM import of its own), idempotent, never raises for an
unsupported vLLM, and raises for a bad ``VLLM_FP4_MOE_PLUGIN*`` value, the plugin on or off. The
probe and the patches run when vLLM first imports its NVFP4 MoE modules (the import hook in
:mod:`.base.vllm_modules`).
"""

from __future__ import annotations

import contextlib
import importlib
import os

# What register() imports, the switch on or off: base, these two and nothing else of the plugin
# (tests/ut/test_import_budget.py); the rest comes in import hooks' callbacks and on-paths.
from vllm_fp4_moe_plugin.base import envs  # cheap, vLLM-free
from vllm_fp4_moe_plugin.base import vllm_modules as vm  # vLLM-free; the import hook too

__version__ = "0.1.0"

# None until register(); then "inert", "pending", "inactive", "active" or "failed" (a patch
# could not be applied: none is, and importing vLLM's NVFP4 MoE modules raises).
_state: str | None = None
_reason: str = ""
_design = None  # support.Design the probe saw when the switch is on (None: unknown / not yet)


def get_logger():
    from vllm_fp4_moe_plugin.base.log import get_logger as plugin_logger

    return plugin_logger()


class PluginInactiveError(RuntimeError):
    """``VLLM_FP4_MOE_PLUGIN=1`` with ``VLLM_FP4_MOE_PLUGIN_CHECK=strict``, on a vLLM the
    plugin cannot patch: the process refuses to start rather than serve stock vLLM."""


def register() -> None:
    """Entry point for vLLM's plugin loader."""
    global _state, _reason
    if _state is not None:
        return
    envs.VLLM_FP4_MOE_PLUGIN_CHECK  # noqa: B018 (validated whenever set, the plugin on or off)
    envs.VLLM_FP4_MOE_PLUGIN_TIMEOUT_S  # noqa: B018 (the read validates it, as above)
    parent_has_it_on = envs.VLLM_FP4_MOE_PLUGIN_LAUNCHER
    if not envs.VLLM_FP4_MOE_PLUGIN:  # raises ValueError on a bad value: fail loudly
        _state, _reason = "inert", "VLLM_FP4_MOE_PLUGIN is not 1"
        if parent_has_it_on:  # started by a process that has it on: this environment overrides it
            switch = os.environ.get("VLLM_FP4_MOE_PLUGIN")
            get_logger().warning(
                "vllm-fp4-moe-plugin is off in this process (%s), but the "
                "process that started it has VLLM_FP4_MOE_PLUGIN=1: this process's own "
                "environment overrides it (for Ray: where `ray start` ran), so it computes as "
                "stock vLLM. Unset the variable there or set it to 1 (docs/DEPLOYING.md).",
                "VLLM_FP4_MOE_PLUGIN unset" if switch is None else f"VLLM_FP4_MOE_PLUGIN={switch}")
        if "VLLM_FP4_MOE_PLUGIN" not in os.environ:  # unset: watch (read-only) and warn once,
            # from when vLLM can build an NVFP4 MoE layer
            vm.run_after_first_import(vm.TRIGGER_MODULES, _install_off_warning)
        _join_fleet()  # off too: a rank that runs the fix must know it is next to this one
        return
    _state, _reason = "pending", "waiting for vLLM to import its NVFP4 MoE modules"
    if not parent_has_it_on:  # the first process of the deployment: what it starts inherits this
        os.environ["VLLM_FP4_MOE_PLUGIN_LAUNCHER"] = "1"
    vm.run_after_first_import(vm.TRIGGER_MODULES, _install)
    _join_fleet()


def _install_off_warning() -> None:
    from vllm_fp4_moe_plugin.patches import off_warning

    off_warning.install()


def _join_fleet() -> None:
    """Off too: a rank that runs the fix must know it is next to this one. From when vLLM
    imports its parallel state (the world group is built after)."""
    vm.run_after_first_import((vm.PARALLEL_STATE,), _install_fleet_rendezvous)


def _install_fleet_rendezvous() -> None:
    """Never stops a process: where it cannot be installed, only a rank that is on says so."""
    from vllm_fp4_moe_plugin.patches import fleet_rendezvous  # and patching: nothing else

    try:
        if fleet_rendezvous.install(_report):
            return
        why = "init_distributed_environment does not call init_world_group"
    except Exception as exc:  # off must not stop vLLM
        why = f"{type(exc).__name__}: {exc}"
    (get_logger().debug if _state == "inert" else get_logger().warning)(
        "vllm-fp4-moe-plugin: the fleet check cannot run on this vLLM (%s), so ranks are not "
        "compared: set VLLM_FP4_MOE_PLUGIN=1 on every node yourself (docs/DEPLOYING.md).", why)


def _list_plugin_env() -> None:
    """vLLM lists the plugin's variables; outside the MoE fix's all-or-nothing (the fleet check
    stops workers that miss the switch; the WARNING says how to give it to them)."""
    from vllm_fp4_moe_plugin.patches import ledger

    try:
        ledger.list_plugin_env()
    except ledger.PatchInstallError as exc:
        get_logger().warning(
            "%s. Ray workers and Ray data-parallel engine cores of this vLLM may then start "
            "without VLLM_FP4_MOE_PLUGIN: set it where `ray start` runs on every node (or list "
            "it in VLLM_RAY_EXTRA_ENV_VARS_TO_COPY where vLLM has that variable).", exc)


def _report():
    """For the fleet check: what this process will serve (switch on and still pending: import
    a trigger module now, so the probe and the patches run first)."""
    from vllm_fp4_moe_plugin.patches.fleet import Report

    if _state == "pending":
        with contextlib.suppress(ImportError):  # a vLLM without it: reported as "pending"
            importlib.import_module(vm.MODELOPT)
    return Report(__version__, _state, _reason, _design)


def _on_parameter(module, name: str, param) -> None:
    """The first NVFP4 MoE layer, switch on: warn if the fleet check never ran."""
    if name in vm.NVFP4_MOE_MARKERS and _unchecked_watch is not None:
        _unchecked_watch.stop()
        from vllm_fp4_moe_plugin.patches import fleet

        fleet.warn_if_unchecked()


_unchecked_watch = None  # param_watch.ParamWatch(_on_parameter), switch on, once vLLM can build


def _watch_unchecked() -> None:
    global _unchecked_watch
    from vllm_fp4_moe_plugin.base.param_watch import ParamWatch

    if _unchecked_watch is None:
        _unchecked_watch = ParamWatch(_on_parameter)
    _unchecked_watch.install()


def _install() -> None:
    _watch_unchecked()  # one hook per module set: the import hooks do not chain
    # vLLM must know the plugin's variables before it starts workers (up to 0.13.x Ray copies
    # only what it lists): vLLM imports the trigger modules while it builds its config, before
    # any executor exists (a config unpickled in an engine core imports them too)
    _list_plugin_env()
    _install_fix()


def _install_fix() -> None:
    """Probe the installed vLLM, let the ledger decide, apply; one line either way: INFO when
    active or when upstream already computes right, a WARNING (strict: an error) when the installed
    vLLM cannot be patched."""
    global _state, _reason, _design
    from vllm_fp4_moe_plugin.patches import ledger

    logger = get_logger()
    result = ledger.plan()
    _design = result.design
    if not result.install:
        _state, _reason = "inactive", result.reason
        if result.upstream_fixed:  # upstream already computes right: nothing to fix
            logger.info("vllm-fp4-moe-plugin inactive: %s.", result.reason)
            return
        try:
            _refuse_or_warn_inactive(result.reason)
        except PluginInactiveError:
            _state = "failed"
            raise
        return
    try:  # all or nothing: on failure no patch is left and this process refuses to serve
        replaced = ledger.apply_targets(result.design, result.patches)
    except ledger.PatchInstallError as exc:
        _state, _reason = "failed", str(exc)
        logger.error("%s", exc)
        vm.refuse(vm.TRIGGER_MODULES, exc)  # a retried import must not serve unpatched
        raise
    _state, _reason = "active", result.reason
    from vllm_fp4_moe_plugin.base.support import Design
    from vllm_fp4_moe_plugin.scales import unloaded

    # activation scales the checkpoint lacks become known, not guessed (unless vLLM itself
    # initialises them to NaN and repairs them: finding upstream_repairs_uncalibrated)
    if not result.findings.get("upstream_repairs_uncalibrated"):
        unloaded.watch(unloaded.any_layer if result.design is Design.NVFP4_ORACLE
                       else unloaded.repaired_by_plugin_class)
    logger.info("vllm-fp4-moe-plugin active: replaced %s.",
                ", ".join(replaced or ledger.applied_targets()))


def _refuse_or_warn_inactive(reason: str) -> None:
    """Asked for and not given: a WARNING in every process, or (strict) no start at all."""
    message = (f"vllm-fp4-moe-plugin is enabled (VLLM_FP4_MOE_PLUGIN=1) but inactive: {reason}. "
               "This process runs stock vLLM, whose NVFP4 MoE answers may be wrong; run "
               "`vllm-fp4-moe doctor` to see why")
    if envs.VLLM_FP4_MOE_PLUGIN_CHECK == "strict":
        error = PluginInactiveError(message + "; VLLM_FP4_MOE_PLUGIN_CHECK=strict refuses to "
                                    "start. Install a vLLM release the plugin supports "
                                    "(docs/SUPPORT.md), or unset the strict check to serve "
                                    "stock vLLM.")
        get_logger().error("%s", error)
        vm.refuse(vm.TRIGGER_MODULES, error)
        raise error
    get_logger().warning("%s.", message)


def state() -> tuple[str | None, str]:
    """(state, reason) of this process: for diagnostics and tests."""
    return _state, _reason


def _reset_for_tests() -> None:
    """Undo register(): revert patches, drop a pending import hook, forget the decision."""
    global _state, _reason, _design
    from vllm_fp4_moe_plugin.patches import fleet, ledger, off_warning
    from vllm_fp4_moe_plugin.scales import unloaded

    vm.remove()
    off_warning.remove()
    ledger.revert_all()
    if _unchecked_watch is not None:
        _unchecked_watch.remove()
    fleet._reset_for_tests()
    unloaded.remove()
    _state, _reason, _design = None, "", None
