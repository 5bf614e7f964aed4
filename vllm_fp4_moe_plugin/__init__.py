"""vllm-fp4-moe-plugin: correct NVFP4 MoE activation scales on vLLM 0.11.0.

vLLM calls :func:`register` in every process it starts (API server, engine cores, workers) via
the ``vllm.general_plugins`` entry point ``fp4_moe``. It is cheap when disabled, idempotent, and
never raises for an environment it does not support; it raises only for an explicit
misconfiguration (a bad ``VLLM_FP4_MOE_PLUGIN`` value).
"""

from __future__ import annotations

__version__ = "0.1.0"

# None until register() has decided; then "inert", "inactive" or "active".
_state: str | None = None
_reason: str = ""


def register() -> None:
    """Entry point for vLLM's plugin loader."""
    global _state, _reason
    if _state is not None:
        return
    from vllm_fp4_moe_plugin import envs
    from vllm_fp4_moe_plugin.log import get_logger

    logger = get_logger()
    if not envs.VLLM_FP4_MOE_PLUGIN:  # raises ValueError on a bad value: fail loudly
        _state, _reason = "inert", "VLLM_FP4_MOE_PLUGIN is not 1"
        return
    from vllm_fp4_moe_plugin import compat

    result = compat.probe()
    if not result.install:
        _state, _reason = "inactive", result.reason
        logger.info("vllm-fp4-moe-plugin inactive: %s.", result.reason)
        return
    from vllm_fp4_moe_plugin import patches

    replaced = patches.apply_all()
    _state, _reason = "active", result.reason
    logger.info("vllm-fp4-moe-plugin active: replaced %s.",
                ", ".join(replaced or patches.applied_targets()))


def state() -> tuple[str | None, str]:
    """(state, reason) of this process: for diagnostics and tests."""
    return _state, _reason


def _reset_for_tests() -> None:
    """Undo register(): revert patches and forget the decision."""
    global _state, _reason
    from vllm_fp4_moe_plugin import patches

    patches.revert_all()
    _state, _reason = None, ""
