# SPDX-License-Identifier: Apache-2.0
"""Jobs that run inside a simulated rank (``simulation.layouts.spawn``); each returns plain data.

One job loads every written checkpoint, because starting vLLM in a fresh process is the
expensive part of these tests.
"""

from __future__ import annotations

import traceback

from safetensors import safe_open


def _checkpoint_tensors(path: str) -> dict:
    from vllm_fp4_moe_plugin.tools.checkpoint.tensor_index import tensor_files

    out = {}
    for name, f in tensor_files(path).items():
        with safe_open(str(f), framework="pt") as handle:
            out[name] = handle.get_tensor(name)
    return out


def _methods(model) -> tuple[dict, dict]:
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE
    from vllm.model_executor.layers.linear import LinearBase

    linear, moe = {}, {}
    for prefix, module in model.named_modules():
        if isinstance(module, FusedMoE):
            moe[prefix] = type(module.quant_method).__name__
        elif isinstance(module, LinearBase):
            linear[prefix] = type(module.quant_method).__name__
    return linear, moe


def _scale_rows(loaded, moe_prefixes, fmt: str) -> dict:
    """Per MoE layer: the GEMM1/GEMM2 input-scale parameters as loaded, and after processing."""
    kind = "input_scale" if fmt == "modelopt" else "input_global_scale"
    out = {}
    modules = dict(loaded.model.named_modules())
    for prefix in moe_prefixes:
        layer = modules[prefix]
        out[prefix] = {
            "w13_raw": loaded.raw_params[f"{prefix}.w13_{kind}"].float().tolist(),
            "w2_raw": loaded.raw_params[f"{prefix}.w2_{kind}"].float().tolist(),
            "w13_input_scale_quant": layer.w13_input_scale_quant.float().tolist(),
            "w2_input_scale_quant": layer.w2_input_scale_quant.float().tolist(),
            "g1_alphas": layer.g1_alphas.float().tolist(),
        }
    return out


def load_checkpoints(ctx, checkpoints: dict) -> dict:
    """``checkpoints``: ``{key: (fmt, path)}``. Load each with vLLM's real model class and
    loader; report coverage, the quant methods chosen and the scale parameters."""
    from tests.checkpoint.vllm_load import load_model, unfilled_expert_slots, unreached_tensors

    results = {}
    for key, (fmt, path) in checkpoints.items():
        try:
            loaded = load_model(path, ctx.vllm_config.parallel_config)
            tensors = _checkpoint_tensors(path)
            linear, moe = _methods(loaded.model)
            results[key] = {
                "model_class": type(loaded.model).__name__,
                "quantization": loaded.model_config.quantization,
                "quant_config": type(loaded.vllm_config.quant_config).__name__,
                "num_checkpoint_tensors": len(tensors),
                "yielded": len(loaded.checkpoint_names),
                "unreached": unreached_tensors(loaded, tensors),
                "unfilled": unfilled_expert_slots(loaded, tensors),
                "params_not_loaded": sorted(set(loaded.raw_params) - loaded.loaded_params),
                "linear_methods": linear,
                "moe_methods": moe,
                "scales": _scale_rows(loaded, sorted(moe), fmt),
            }
        except Exception:  # report per checkpoint; the test prints it
            results[key] = {"error": traceback.format_exc()}
    return results
