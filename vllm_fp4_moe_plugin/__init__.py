"""vllm-fp4-moe-plugin: correct NVFP4 MoE activation scales on stock vLLM (0.11.0 to 0.34.0).

vLLM calls :func:`register` in every process it starts (API server, engine cores, workers) via
the ``vllm.general_plugins`` entry point ``fp4_moe``. It is cheap (no vLLM import of its own),
idempotent, and never raises for an environment it does not support; it raises only for an
explicit misconfiguration (a bad ``VLLM_FP4_MOE_PLUGIN`` or ``VLLM_FP4_MOE_PLUGIN_CHECK``
value, whether the plugin is on or off).

The probe and the patches run when vLLM first imports its NVFP4 MoE quantization modules
(immediately if it already has): see :mod:`vllm_fp4_moe_plugin.import_hook`.
"""

from __future__ import annotations

import os

from vllm_fp4_moe_plugin.vllm_modules import TRIGGER_MODULES  # cheap and vLLM-free

__version__ = "0.1.0"

# None until register() runs; then "inert", "pending", "inactive", "active" or "failed" (a
# patch could not be applied: none is, and importing vLLM's NVFP4 MoE modules raises).
_state: str | None = None
_reason: str = ""


def register() -> None:
    """Entry point for vLLM's plugin loader."""
    global _state, _reason
    if _state is not None:
        return
    from vllm_fp4_moe_plugin import envs

    envs.VLLM_FP4_MOE_PLUGIN_CHECK  # validated whenever set, the plugin on or off
    if not envs.VLLM_FP4_MOE_PLUGIN:  # raises ValueError on a bad value: fail loudly
        _state, _reason = "inert", "VLLM_FP4_MOE_PLUGIN is not 1"
        if "VLLM_FP4_MOE_PLUGIN" not in os.environ:  # unset: watch (read-only) and warn once
            from vllm_fp4_moe_plugin import off_warning

            off_warning.install()
        return
    from vllm_fp4_moe_plugin import import_hook

    _state, _reason = "pending", "waiting for vLLM to import its NVFP4 MoE modules"
    import_hook.run_after_first_import(TRIGGER_MODULES, _install)


def _install() -> None:
    """Probe the installed vLLM, let the ledger decide, apply; one INFO line either way."""
    global _state, _reason
    from vllm_fp4_moe_plugin import patches
    from vllm_fp4_moe_plugin.log import get_logger

    logger = get_logger()
    result = patches.plan()
    if not result.install:
        _state, _reason = "inactive", result.reason
        logger.info("vllm-fp4-moe-plugin inactive: %s.", result.reason)
        return
    try:  # all or nothing: on failure no patch is left and this process refuses to serve
        replaced = patches.apply_targets(result.design, result.patches)
    except patches.PatchInstallError as exc:
        from vllm_fp4_moe_plugin import import_hook

        _state, _reason = "failed", str(exc)
        logger.error("%s", exc)
        import_hook.refuse(TRIGGER_MODULES, exc)  # a retried import must not serve unpatched
        raise
    _state, _reason = "active", result.reason
    logger.info("vllm-fp4-moe-plugin active: replaced %s.",
                ", ".join(replaced or patches.applied_targets()))


def state() -> tuple[str | None, str]:
    """(state, reason) of this process: for diagnostics and tests."""
    return _state, _reason


def _reset_for_tests() -> None:
    """Undo register(): revert patches, drop a pending import hook, forget the decision."""
    global _state, _reason
    from vllm_fp4_moe_plugin import import_hook, off_warning, patches

    import_hook.remove()
    off_warning.remove()
    patches.revert_all()
    _state, _reason = None, ""
