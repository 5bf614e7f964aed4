# SPDX-License-Identifier: Apache-2.0
"""The MODULAR_METHOD design's probe (vLLM 0.11.1-0.13.0): which of the holes upstream left are
still there, seen by running vLLM's own code on CPU where a name alone cannot tell. vLLM-free at
import."""

from __future__ import annotations

from typing import Any, Optional

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.patching import original_attr
from vllm_fp4_moe_plugin.patches.probing import Observation, has, missing_methods, on_cpu, same

FINDINGS = ("compressed_tensors_class", "compressed_tensors_dp_scale_shared",
            "all2allv_tp_prequantizes", "modelopt_nvfp4_moe_method", "modelopt_method_cls_attr")
_OVERRIDDEN = ("process_weights_after_loading", "get_fused_moe_quant_config",
               "maybe_make_prepare_finalize", "select_gemm_impl")


def compressed_tensors_nvfp4_class_name() -> Optional[str]:
    """The name under which this vLLM's compressed-tensors module defines the NVFP4 MoE method."""
    return next((n for n in vm.CT_NVFP4_CLASS_NAMES if has(vm.COMPRESSED_TENSORS_MOE, n)), None)


def all2allv_tp_prequantizes() -> bool:
    """P6, behavioural: does the all-to-all prepare still quantize when there is no DP (v0111
    PF:104-113)? ``prepare`` on two CPU tokens: the fixed code returns the input tensor itself,
    the unfixed one tries to quantize (FlashInfer refuses CPU tensors) or returns another."""
    import torch
    from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

    pf_cls = original_attr(vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE,
                           "FlashInferAllToAllMoEPrepareAndFinalize")
    one = torch.ones(1)
    cfg = nvfp4_moe_quant_config(g1_alphas=one, g2_alphas=one, a1_gscale=one, a2_gscale=one,
                                 w1_scale=one, w2_scale=one)
    a1 = torch.zeros(2, 32, dtype=torch.bfloat16)
    try:
        out = pf_cls(use_dp=False).prepare(a1, torch.ones(2, 1), torch.zeros(2, 1,
                                           dtype=torch.int32), 2, None, False, cfg)
    except Exception:
        return True
    return out[0] is not a1


def compressed_tensors_dp_scale_shared(cls_name: str) -> bool:
    """P4, behavioural: does compressed-tensors give every expert one GEMM1 activation scale
    under DP dispatch (the hole: v0111 CT:358-368, v0120 CT:378-393)? Runs the method's own
    ``process_weights_after_loading`` (FlashInfer CUTLASS, DP=2, ``swizzle_blockscale`` the
    identity) on a two-expert CPU layer whose input global scales differ; anything that hides
    the vector counts as not shared (the patch is a no-op where the scales agree)."""
    import types

    import torch
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import FlashinferMoeBackend

    cls = original_attr(vm.COMPRESSED_TENSORS_MOE, cls_name)
    method = object.__new__(cls)
    parallel = types.SimpleNamespace(dp_size=2, tp_size=1, ep_size=2, use_ep=True,
                                     use_dp=True)
    method.__dict__.update(allow_flashinfer=True, use_marlin=False,
                           flashinfer_moe_backend=FlashinferMoeBackend.CUTLASS,
                           moe=types.SimpleNamespace(moe_parallel_config=parallel))
    e, n, k = 2, 128, 128
    layer: Any = torch.nn.Module()
    tensors = {"w13_weight_packed": torch.zeros(e, 2 * n, k // 2, dtype=torch.uint8),
               "w2_weight_packed": torch.zeros(e, k, n // 2, dtype=torch.uint8),
               "w13_weight_scale": torch.ones(e, 2 * n, k // 16).to(torch.float8_e4m3fn),
               "w2_weight_scale": torch.ones(e, k, n // 16).to(torch.float8_e4m3fn),
               "w13_weight_global_scale": torch.ones(e, 2), "w2_weight_global_scale": torch.ones(e),
               "w13_input_global_scale": torch.tensor([[1.0, 1.0], [4.0, 4.0]]),
               "w2_input_global_scale": torch.ones(e)}
    for name, t in tensors.items():
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    layer.num_experts = layer.local_num_experts = layer.global_num_experts = e
    try:
        on_cpu(cls.process_weights_after_loading, swizzle_blockscale=same)(method, layer)
    except Exception:
        pass  # read what was set before the failure
    vec = getattr(layer, "w13_input_scale_quant", None)
    if not isinstance(vec, torch.Tensor) or vec.numel() < e:
        return False
    vec = vec.detach().float().reshape(-1)
    return bool((vec == vec[0]).all())


def observe(findings: dict) -> Observation:
    d = Design.MODULAR_METHOD
    ct_name = compressed_tensors_nvfp4_class_name()
    findings["compressed_tensors_class"] = ct_name
    findings["compressed_tensors_dp_scale_shared"] = (
        ct_name is not None and compressed_tensors_dp_scale_shared(ct_name))
    findings["all2allv_tp_prequantizes"] = (
        has(vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllToAllMoEPrepareAndFinalize")
        and all2allv_tp_prequantizes())
    # the ModelOpt method whose dead expert scales the plugin repairs before upstream's code
    findings["modelopt_nvfp4_moe_method"] = has(vm.MODELOPT, "ModelOptNvFp4FusedMoE") and \
        not missing_methods(vm.MODELOPT, "ModelOptNvFp4FusedMoE",
                               ("process_weights_after_loading",))
    # ... which the config may create from a class attribute bound at import (v0120 :1636)
    findings["modelopt_method_cls_attr"] = (
        has(vm.MODELOPT, "ModelOptNvFp4Config")
        and "FusedMoEMethodCls" in vars(original_attr(vm.MODELOPT, "ModelOptNvFp4Config"))
        and original_attr(vm.MODELOPT, "ModelOptNvFp4Config.FusedMoEMethodCls")
        is original_attr(vm.MODELOPT, "ModelOptNvFp4FusedMoE"))
    if not (findings["tp_fix_present"] and findings["modelopt_dp_fix_present"]):
        return Observation(d, False, "vLLM has the 0.11.1 MoE design without the upstream TP/DP "
                           "fixes (#27223/#26135) this plugin builds on", findings)
    if ct_name is not None:
        gone = missing_methods(vm.COMPRESSED_TENSORS_MOE, ct_name, _OVERRIDDEN)
        if gone:
            return Observation(d, False, f"{ct_name} lacks {', '.join(gone)}", findings)
    return Observation(d, True, "vLLM modular_method MoE design (0.11.1+): upstream fixed "
                       "ModelOpt and TP", findings)
