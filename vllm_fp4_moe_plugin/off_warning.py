"""One WARNING per process when the plugin is installed, off, and a layer needs it.

Why this way: "off" must leave vLLM untouched, so nothing of vLLM is replaced. Instead a
read-only torch hook watches parameter registration, which happens only at load time: vLLM
0.11.0 registers ``w13_input_scale_quant`` on every NVFP4 MoE layer in
``process_weights_after_loading`` (modelopt.py:1317, compressed_tensors_moe.py:307). If that
per-expert vector is not uniform on a FlashInfer path, stock vLLM computes the layer wrongly in
every layout. The hook removes itself after warning once (or never fires): no per-forward cost.
"""

from __future__ import annotations

from typing import Optional

from vllm_fp4_moe_plugin.log import get_logger

logger = get_logger("off")
WATCHED = "w13_input_scale_quant"
METHODS = ("ModelOptNvFp4FusedMoE", "CompressedTensorsW4A4MoeMethod")

_handle = None


def _on_parameter(module, name: str, param) -> None:
    if name != WATCHED:
        return None
    qm = getattr(module, "quant_method", None)
    if (type(qm).__name__ not in METHODS or not getattr(qm, "allow_flashinfer", False)
            or getattr(qm, "use_marlin", False)):
        return None
    v = param.detach().float().reshape(-1)
    if v.numel() < 2 or bool(v.max() == v.min()):
        return None
    layer = getattr(module, "layer_name", "") or type(module).__name__
    logger.warning(
        "vllm-fp4-moe-plugin is installed but off, and accuracy is at risk: %s has per-expert "
        "GEMM1 input scales spread %.3gx, which stock vLLM 0.11.0's FlashInfer NVFP4 MoE computes "
        "wrongly in every parallel layout. Set VLLM_FP4_MOE_PLUGIN=1 to enable the fix "
        "(VLLM_FP4_MOE_PLUGIN=0 silences this warning).", layer, float(v.max() / v.min()))
    remove()
    return None


def install() -> None:
    global _handle
    if _handle is None:
        from torch.nn.modules.module import register_module_parameter_registration_hook

        _handle = register_module_parameter_registration_hook(_on_parameter)


def remove() -> None:
    global _handle
    if _handle is not None:
        _handle.remove()
        _handle = None


def installed() -> Optional[bool]:
    return _handle is not None
