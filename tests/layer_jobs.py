# SPDX-License-Identifier: Apache-2.0
"""Jobs that run inside simulated ranks (spawned by ``layouts.spawn``); each returns plain data.

They bundle many checks per process start, because starting vLLM in a fresh process is the
expensive part of these tests.
"""

from __future__ import annotations

import os

import torch

from fp4_moe_lab.checkpoint.expert_tensors import expert_tensors
from fp4_moe_lab.nvfp4 import random_experts
from fp4_moe_lab.simulation import moe_layer
from fp4_moe_lab.simulation.layouts import Scenario, stock_and_plugin_outputs
from vllm_fp4_moe_plugin.patches import ledger

FORMATS = ("modelopt", "compressed-tensors")
PREFIX = "model.layers.{index}.mlp.experts"
_index = iter(range(1000, 100000))


def _build(experts, fmt, *, plugin: bool, **kw):
    (ledger.apply_all if plugin else ledger.revert_all)()
    try:
        return moe_layer.build_layer(experts, fmt, top_k=2, index=next(_index), **kw)
    finally:
        ledger.revert_all()


def _error_of(fn):
    try:
        fn()
    except Exception as exc:  # the tests assert on type and text
        return f"{type(exc).__name__}: {exc}"
    return None


def _bad_scale_name(fmt: str, kind: str) -> tuple[str, str]:
    """(checkpoint tensor suffix, vLLM parameter the plugin must name) for a planted bad scale."""
    if fmt == "modelopt":
        # vLLM 0.11.0 writes a ModelOpt input_scale into the whole [e] row, so the *last* of
        # gate/up wins (layer.py:1482-1497): plant it on up_proj, which loads after gate_proj.
        return {"input": ("up_proj.input_scale", "w13_input_scale"),
                "weight": ("up_proj.weight_scale_2", "w13_weight_scale_2"),
                "w2_input": ("down_proj.input_scale", "w2_input_scale")}[kind]
    return {"input": ("gate_proj.input_global_scale", "w13_input_global_scale"),
            "weight": ("up_proj.weight_global_scale", "w13_weight_global_scale"),
            "w2_input": ("down_proj.input_global_scale", "w2_input_global_scale")}[kind]


BAD_VALUES = {"nan": float("nan"), "inf": float("inf"), "zero": 0.0, "negative": -1.0}


def _build_with_bad_scale(experts, fmt, suffix, value, *, plugin: bool):
    """Build with expert 3's ``suffix`` tensor replaced by ``value``; return the error text."""
    index = next(_index)
    prefix = PREFIX.format(index=index)
    name = f"{prefix}.3.{suffix}"
    shape = expert_tensors(experts, fmt, prefix)[name].shape
    (ledger.apply_all if plugin else ledger.revert_all)()
    try:
        return prefix, _error_of(lambda: moe_layer.build_layer(
            experts, fmt, top_k=2, index=index, overrides={name: torch.full(shape, value)}))
    finally:
        ledger.revert_all()


def bad_scales(ctx) -> dict:
    """Plant one bad global scale at expert 3; record what stock and plugin do with it."""
    experts = random_experts(8, 256, 512, seed=1)
    out = {}
    for fmt in FORMATS:
        for kind in ("input", "weight", "w2_input"):
            suffix, param = _bad_scale_name(fmt, kind)
            for label, value in BAD_VALUES.items():
                _, stock = _build_with_bad_scale(experts, fmt, suffix, value, plugin=False)
                layer, plugin = _build_with_bad_scale(experts, fmt, suffix, value, plugin=True)
                out[f"{fmt}/{kind}/{label}"] = {"param": param, "layer": layer,
                                                "stock": stock, "plugin": plugin}
    return out


def _state(layer) -> dict:
    tensors = {k: v.detach().clone() for k, v in layer.named_parameters()}
    for attr in ("g1_alphas", "g2_alphas", "w13_input_scale_quant", "w2_input_scale_quant",
                 "g1_scale_c"):
        if hasattr(layer, attr):
            tensors[attr] = getattr(layer, attr).detach().clone()
    return tensors


def _quant_config_fields(layer):
    cfg = layer.quant_method.get_fused_moe_quant_config(layer)
    if cfg is None:
        return None
    return {k: getattr(cfg, k).detach().clone() for k in
            ("a1_gscale", "a2_gscale", "g1_alphas", "g2_alphas", "w1_scale", "w2_scale")}


def _stock_vs_plugin_state(experts, fmt) -> dict:
    res = {}
    for mode in ("stock", "plugin"):
        b = _build(experts, fmt, plugin=mode == "plugin")
        qm = b.layer.quant_method
        res[mode] = {"state": _state(b.layer), "config": _quant_config_fields(b.layer),
                     "allow_flashinfer": qm.allow_flashinfer, "use_marlin": qm.use_marlin,
                     "prepare_finalize": type(qm.maybe_make_prepare_finalize()).__name__}
    return res


def other_backends(ctx) -> dict:
    """vLLM's own CUTLASS path, Marlin, and the TRT-LLM backend: stock vs plugin state."""
    import vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe as ct
    import vllm.model_executor.layers.quantization.modelopt as mo
    import vllm.model_executor.layers.quantization.utils.nvfp4_moe_support as support

    experts = random_experts(8, 256, 512, seed=2)
    out: dict = {}
    # vLLM CUTLASS (FlashInfer MoE off): SM100 is reported, VLLM_USE_FLASHINFER_MOE_FP4=0.
    os.environ["VLLM_USE_FLASHINFER_MOE_FP4"] = "0"
    for fmt in FORMATS:
        out[f"vllm_cutlass/{fmt}"] = _stock_vs_plugin_state(experts, fmt)
    # Marlin: a GPU without FP4 CUTLASS. Its CUDA-only weight repack is replaced by a no-op:
    # the point is what our subclass does around it, which must be nothing.
    saved = (support.cutlass_fp4_supported, support.is_fp4_marlin_supported,
             mo.prepare_moe_fp4_layer_for_marlin, ct.prepare_moe_fp4_layer_for_marlin)
    support.cutlass_fp4_supported = lambda: False
    support.is_fp4_marlin_supported = lambda: True
    mo.prepare_moe_fp4_layer_for_marlin = ct.prepare_moe_fp4_layer_for_marlin = lambda layer: None
    try:
        for fmt in FORMATS:
            out[f"marlin/{fmt}"] = _stock_vs_plugin_state(experts, fmt)
    finally:
        (support.cutlass_fp4_supported, support.is_fp4_marlin_supported,
         mo.prepare_moe_fp4_layer_for_marlin, ct.prepare_moe_fp4_layer_for_marlin) = saved
    # TRT-LLM ("latency") backend, ModelOpt only in 0.11.0.
    os.environ["VLLM_USE_FLASHINFER_MOE_FP4"] = "1"
    os.environ["VLLM_FLASHINFER_MOE_BACKEND"] = "latency"
    # TRT-LLM's weight shuffles index fp8 tensors, which CPU torch cannot; the shuffle only
    # reorders weights for the kernel and never touches the scales under test.
    original_cls = ledger.LEDGER[0].original()
    saved_shuffle = original_cls.prepare_static_weight_layouts_for_trtllm_moe
    original_cls.prepare_static_weight_layouts_for_trtllm_moe = (
        lambda self, w13, w2, s13, s2, *rest: (w13.data.clone(), s13.data.clone(),
                                               w2.data.clone(), s2.data.clone()))
    try:
        res = {}
        for mode in ("stock", "plugin"):
            b = _build(experts, "modelopt", plugin=mode == "plugin")
            layer = b.layer
            res[mode] = {k: getattr(layer, k).detach().float().clone() for k in
                         ("w13_input_scale_quant", "g1_alphas", "g1_scale_c",
                          "w13_weight_scale_2", "w2_input_scale_quant")}
            res[mode]["backend"] = str(layer.quant_method.flashinfer_moe_backend)
        out["trtllm/modelopt"] = res
    finally:
        os.environ["VLLM_FLASHINFER_MOE_BACKEND"] = "throughput"
        original_cls.prepare_static_weight_layouts_for_trtllm_moe = saved_shuffle
    return out


def uniform_scales_control(ctx) -> object:
    """Stock and plugin on a fixture whose experts all share one input scale."""
    return stock_and_plugin_outputs(ctx, Scenario(input_scale_spread=1.0), FORMATS,
                                    ("stock", "plugin"))


def placement_guards(ctx) -> dict:
    """Run under EP=2 with --expert-placement-strategy round_robin."""
    out = {}
    grouped = dict(use_grouped_topk=True, num_expert_group=2, topk_group=1)
    experts8 = random_experts(8, 256, 512, seed=3)
    experts7 = random_experts(7, 256, 512, seed=3)
    for fmt in FORMATS:
        for mode in ("stock", "plugin"):
            def build_grouped(fmt=fmt, mode=mode):
                b = _build(experts8, fmt, plugin=mode == "plugin", **grouped)
                out[f"round_robin/{fmt}/{mode}/map"] = b.layer.expert_map.tolist()
            out[f"round_robin/{fmt}/{mode}"] = _error_of(build_grouped)
            out[f"uneven/{fmt}/{mode}"] = _error_of(
                lambda fmt=fmt, mode=mode: _build(experts7, fmt, plugin=mode == "plugin"))
            out[f"eplb/{fmt}/{mode}"] = _error_of(
                lambda fmt=fmt, mode=mode: _build(experts8, fmt, plugin=mode == "plugin",
                                                  enable_eplb=True))
    return out


def check_modes(ctx) -> dict:
    """The load-time check on a consistent layer, and on a deliberately inconsistent one: the
    methods patched but the direct call left stock, so prepare pre-quantizes with expert 0's
    scale while the config says per expert."""
    import logging

    from vllm_fp4_moe_plugin.patches import consistency

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logging.getLogger("vllm.fp4_moe_plugin").addHandler(Keep())
    experts = random_experts(8, 256, 512, seed=4)
    out = {}
    direct_call = ledger.LEDGER[2]
    for setup in ("consistent", "inconsistent"):
        for mode in ("off", "warn", "strict"):
            os.environ["VLLM_FP4_MOE_PLUGIN_CHECK"] = mode
            consistency.reset_for_tests()  # each case stands for a fresh model load
            records.clear()
            ledger.apply_all()
            if setup == "inconsistent":
                direct_call.revert()
            try:
                error = _error_of(lambda: moe_layer.build_layer(
                    experts, "modelopt", top_k=2, index=next(_index)))
            finally:
                ledger.revert_all()
            last = consistency.last_result()
            out[f"{setup}/{mode}"] = {
                "error": error, "check": None if last is None else (last.ok, last.reason),
                "logs": list(records)}
    os.environ["VLLM_FP4_MOE_PLUGIN_CHECK"] = "warn"
    return out


def off_warning(ctx) -> dict:
    """register() with the switch unset / "0", then stock layers with spread or uniform
    scales: which processes warn?"""
    import logging

    import vllm_fp4_moe_plugin as plugin

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append((record.levelname, record.getMessage()))

    logging.getLogger("vllm.fp4_moe_plugin").addHandler(Keep())
    out = {}
    for switch in ("unset", "0"):
        for spread in (4.0, 1.0):
            plugin._reset_for_tests()
            records.clear()
            os.environ.pop("VLLM_FP4_MOE_PLUGIN", None)
            if switch == "0":
                os.environ["VLLM_FP4_MOE_PLUGIN"] = "0"
            plugin.register()
            experts = random_experts(8, 256, 512, seed=6, input_scale_spread=spread)
            for fmt in FORMATS:  # two layers: still one warning per process
                moe_layer.build_layer(experts, fmt, top_k=2, index=next(_index))
            out[f"{switch}/{spread}"] = [m for lvl, m in records if lvl == "WARNING"]
    plugin._reset_for_tests()
    os.environ.pop("VLLM_FP4_MOE_PLUGIN", None)
    return out
