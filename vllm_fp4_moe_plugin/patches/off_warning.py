# SPDX-License-Identifier: Apache-2.0
"""One WARNING per process when the plugin is installed, off, and a layer needs it.

Read-only (a :mod:`.param_watch` hook). Pre-oracle designs: at risk if the per-expert
``w13_input_scale_quant`` (v0110 modelopt.py:1317, compressed_tensors_moe.py:307) is not uniform;
oracle: compressed-tensors in a layout mixing ranks' scales. Warns once; never waits or refuses."""

from __future__ import annotations

from typing import Optional

from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.log import get_logger, layer_label
from vllm_fp4_moe_plugin.base.param_watch import ParamWatch

logger = get_logger("off")
WATCHED = "w13_input_scale_quant"
WATCHED_ORACLE = "w13_input_global_scale"  # compressed-tensors' GEMM1 input scales, 0.14.0+
METHODS = ("ModelOptNvFp4FusedMoE", "CompressedTensorsW4A4MoeMethod",
           "CompressedTensorsW4A4Nvfp4MoEMethod")

def _on_parameter(module, name: str, param) -> None:
    if name == WATCHED_ORACLE:
        return _on_oracle_parameter(module)
    if name != WATCHED:
        return None
    qm = getattr(module, "quant_method", None)
    if (type(qm).__name__ not in METHODS or not getattr(qm, "allow_flashinfer", False)
            or getattr(qm, "use_marlin", False)):
        return None
    v = param.detach().float().reshape(-1)
    if v.numel() < 2 or bool(v.max() == v.min()):
        return None
    where = _at_risk_where(module)
    if where is None:
        return None
    layer = layer_label(module)
    logger.warning(
        "vllm-fp4-moe-plugin is installed but off, and accuracy is at risk: %s has per-expert "
        "GEMM1 input scales spread %.3gx, which this vLLM's FlashInfer NVFP4 MoE computes "
        "wrongly %s. Set VLLM_FP4_MOE_PLUGIN=1 to enable the fix "
        "(VLLM_FP4_MOE_PLUGIN=0 silences this warning).", layer, float(v.max() / v.min()), where)
    _watch.stop()  # warned once: done (inside torch's hook loop, so not remove())
    return None


_design = None  # support.Design of the installed vLLM, probed at the first NVFP4 MoE layer
_probed = False


def _installed_design():
    global _design, _probed
    if not _probed:  # once per process
        from vllm_fp4_moe_plugin.patches import compat

        _design, _probed = compat.probe().design, True
    return _design


def _at_risk_where(module) -> Optional[str]:
    """None if stock vLLM computes this layer right (``support.stock_hole``); else where not."""
    design = _installed_design()
    if design not in (support.Design.INIT_PREPARE_FINALIZE, support.Design.MODULAR_METHOD):
        return None
    cfg = getattr(module, "moe_parallel_config", None)
    fmt = ("modelopt" if type(module.quant_method).__name__ == "ModelOptNvFp4FusedMoE"
           else "compressed-tensors")
    layout = support.Layout.deployed(tp=getattr(cfg, "tp_size", 1), dp=getattr(cfg, "dp_size", 1),
                                     ep=bool(getattr(cfg, "use_ep", False)))
    if support.stock_hole(design, fmt, layout) != support.WRONG:
        return None
    return support.WHERE_WRONG[design]


def _on_oracle_parameter(module) -> None:
    """NVFP4_ORACLE: warn for a compressed-tensors layer where stock can mix the ranks' scales."""
    from vllm_fp4_moe_plugin.patches.nvfp4_oracle import probe as oracle_probe

    pc = getattr(getattr(module, "moe_config", None), "moe_parallel_config", None)
    if pc is None or not getattr(pc, "use_all2all_kernels", False):
        return None
    if _installed_design() is not support.Design.NVFP4_ORACLE:
        return None
    backend = getattr(getattr(getattr(module, "quant_method", None), "nvfp4_backend", None),
                      "name", "")
    if not support.oracle_design_hole(
            "compressed-tensors", dp=max(pc.dp_size, getattr(pc, "pcp_size", 1)), ep=pc.use_ep,
            all2all_backend=pc.all2all_backend, enable_eplb=getattr(pc, "enable_eplb", False),
            eplb_agrees=oracle_probe.eplb_scale_allreduce(),
            global_scale_backend=backend.startswith("FLASHINFER")):
        return None
    logger.warning(
        "vllm-fp4-moe-plugin is installed but off, and accuracy is at risk: %s is a "
        "compressed-tensors NVFP4 MoE layer under DP+EP with the %s dispatch, which this vLLM "
        "computes wrongly whenever the EP ranks' largest GEMM1 input scales differ (check with "
        "`vllm-fp4-moe audit CHECKPOINT --ep-size %d`). Set VLLM_FP4_MOE_PLUGIN=1 to enable the "
        "fix (VLLM_FP4_MOE_PLUGIN=0 silences this warning).", layer_label(module),
        pc.all2all_backend, pc.ep_size)
    _watch.stop()  # warned once: done (inside torch's hook loop, so not remove())
    return None


_watch = ParamWatch(_on_parameter)


def install() -> None:
    _watch.install()


def remove() -> None:
    _watch.remove()
