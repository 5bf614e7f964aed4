# SPDX-License-Identifier: Apache-2.0
"""Scales-only checkpoints for the audit tests: config files plus the activation-scale tensors,
and index entries for weight tensors that point to a shard that is never written (so any read
of a weight tensor fails loudly)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from fp4_moe_lab.checkpoint.configs import COMPRESSED_TENSORS_NVFP4

MISSING_WEIGHT_SHARD = "model-weights-not-written.safetensors"
SCALE = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}
# Weights and block scales: listed in the index, never written. The per-expert weight global
# scales are scalars the audit validates, so they are written next to the input scales.
WEIGHT_LEAVES = {"modelopt": ("weight", "weight_scale"),
                 "compressed-tensors": ("weight_packed", "weight_scale")}
WEIGHT_GLOBAL = {"modelopt": "weight_scale_2", "compressed-tensors": "weight_global_scale"}
HF_QUANT_CONFIG = {"producer": {"name": "modelopt", "version": "0.23.0"},
                   "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                    "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]}}


# A family's expert projections: GEMM1's (gate and up, or one up) then GEMM2's.
DEEPSEEK_PROJS = ("gate_proj", "up_proj", "down_proj")


def write_config(root: Path, fmt: str, num_experts: int, config: dict | None = None) -> None:
    cfg = config or {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
                     "n_routed_experts": num_experts}
    if fmt == "modelopt":
        (root / "hf_quant_config.json").write_text(json.dumps(HF_QUANT_CONFIG))
    else:
        cfg["quantization_config"] = COMPRESSED_TENSORS_NVFP4
    (root / "config.json").write_text(json.dumps(cfg))


def write_scales_only(root: Path, fmt: str, layers: dict, *, num_shards: int = 1,
                      drop: tuple = (), projs: tuple = DEEPSEEK_PROJS,
                      config: dict | None = None, extra: tuple = ()) -> dict:
    """``layers``: ``{layer_prefix: (w13 [E], w2 [E])}`` stored values (gate = up = w13).
    ``drop``: scale names to leave out; ``projs``: the family's expert projection names (the
    last is GEMM2's); ``config``: config.json instead of DeepSeek-V3's; ``extra``: more scale
    names to write (shared experts, say). Returns ``{name: value}`` of the scales written."""
    root.mkdir(parents=True, exist_ok=True)
    num_experts = len(next(iter(layers.values()))[0])
    write_config(root, fmt, num_experts, config)
    scales: dict[str, float] = {name: 1.0 for name in extra}
    weights: list[str] = []
    for prefix, (w13, w2) in layers.items():
        for e in range(len(w13)):
            for proj, v in [(p, w13[e]) for p in projs[:-1]] + [(projs[-1], w2[e])]:
                scales[f"{prefix}.{e}.{proj}.{SCALE[fmt]}"] = float(np.float32(v))
                scales[f"{prefix}.{e}.{proj}.{WEIGHT_GLOBAL[fmt]}"] = 2.0 ** -10
                weights += [f"{prefix}.{e}.{proj}.{leaf}" for leaf in WEIGHT_LEAVES[fmt]]
    names = [n for n in scales if n not in drop]
    weight_map = {w: MISSING_WEIGHT_SHARD for w in weights}
    per = -(-len(names) // num_shards)
    for k in range(num_shards):
        shard = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        part = names[k * per:(k + 1) * per]
        save_file({n: np.array(scales[n], dtype=np.float32) for n in part}, str(root / shard))
        weight_map.update({n: shard for n in part})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return scales
