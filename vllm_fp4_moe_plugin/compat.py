"""Feature probes of the installed vLLM: does it still have the 0.11.0 bug, in the 0.11.0 design?

Decisions are made from what the code *is*, not from ``vllm.__version__`` (a source build or a
backport would lie). Design note §10 lists the probes; each was checked against 0.11.0 and
0.11.1 sources.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field

_TARGETS = (
    ("vllm.model_executor.layers.quantization.modelopt", "ModelOptNvFp4FusedMoE"),
    ("vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe",
     "CompressedTensorsW4A4MoeMethod"),
    ("vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe", "flashinfer_cutlass_moe_fp4"),
    ("vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe", "FlashInferExperts"),
    ("vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize",
     "FlashInferAllGatherMoEPrepareAndFinalize"),
    ("vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize",
     "FlashInferAllToAllMoEPrepareAndFinalize"),
)
# Methods our subclasses override; if any is gone the design has changed under us.
_OVERRIDDEN = ("create_weights", "process_weights_after_loading", "get_fused_moe_quant_config",
               "maybe_make_prepare_finalize", "select_gemm_impl", "init_prepare_finalize")


@dataclass(frozen=True)
class ProbeResult:
    """What the installed vLLM needs from us. ``install`` is the only field register() acts on."""

    install: bool
    reason: str
    findings: dict[str, bool] = field(default_factory=dict)


def _attr(module: str, name: str):
    return getattr(importlib.import_module(module), name)


def probe() -> ProbeResult:
    """Never raises: any surprise becomes ``install=False`` with the reason."""
    try:
        return _probe()
    except Exception as exc:  # a vLLM we cannot even inspect is not one we patch
        return ProbeResult(False, f"could not inspect vLLM's MoE internals ({exc!r})")


def _probe() -> ProbeResult:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase

    findings: dict[str, bool] = {}
    # P3: 0.11.0 builds modular kernels through FusedMoEMethodBase.init_prepare_finalize;
    # 0.11.1 moved that to FusedMoE.maybe_init_modular_kernel (v0111 layer.py:622).
    findings["design_0_11_0"] = (hasattr(FusedMoEMethodBase, "init_prepare_finalize")
                                 and not hasattr(FusedMoE, "maybe_init_modular_kernel"))
    missing = [f"{m}.{a}" for m, a in _TARGETS if not _has(m, a)]
    findings["targets_present"] = not missing
    if not findings["design_0_11_0"]:
        return ProbeResult(False, "vLLM's MoE internals are not the 0.11.0 design "
                           "(FusedMoE.maybe_init_modular_kernel exists or "
                           "init_prepare_finalize is gone)", findings)
    if missing:
        return ProbeResult(False, "vLLM lacks symbols this plugin replaces: " + ", ".join(missing),
                           findings)
    for cls_name in ("ModelOptNvFp4FusedMoE", "CompressedTensorsW4A4MoeMethod"):
        mod = next(m for m, a in _TARGETS if a == cls_name)
        cls = _attr(mod, cls_name)
        gone = [m for m in _OVERRIDDEN if not callable(getattr(cls, m, None))]
        if gone:
            return ProbeResult(False, f"{cls_name} lacks {', '.join(gone)}", findings)
    experts = _attr("vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe",
                    "FlashInferExperts")
    # P1: 0.11.1's TP fix added FlashInferExperts(use_dp=...) (v0111 flashinfer_cutlass_moe.py:59).
    findings["tp_fix_present"] = "use_dp" in inspect.signature(experts.__init__).parameters
    # P2: 0.11.1's ModelOpt DP fix (v0111 flashinfer_utils.py:292).
    fu = importlib.import_module("vllm.model_executor.layers.quantization.utils.flashinfer_utils")
    findings["modelopt_dp_fix_present"] = hasattr(fu, "is_flashinfer_supporting_global_sf")
    if findings["tp_fix_present"] or findings["modelopt_dp_fix_present"]:
        return ProbeResult(False, "vLLM already carries part of the upstream fix "
                           "(#27223/#26135); the 0.11.0 patches would fight it", findings)
    return ProbeResult(True, "vLLM 0.11.0 MoE design with the per-expert GEMM1 scale bug",
                       findings)


def _has(module: str, name: str) -> bool:
    try:
        _attr(module, name)
    except (ImportError, AttributeError):
        return False
    return True
