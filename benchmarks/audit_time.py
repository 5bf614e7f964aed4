# SPDX-License-Identifier: Apache-2.0
"""Item 5: ``audit_checkpoint`` on a DeepSeek-R1-sized index, scales only.

The checkpoint is written here into a temporary directory: ModelOpt naming (as
``checkpoint/writer.py`` and ``expert_tensors.py`` use), ``hf_quant_config.json`` from
ModelOpt 0.23.0 as R1-FP4 has, 58 MoE layers (3..60) x 256 experts x gate/up/down, each with
its ``input_scale`` and ``weight_scale_2`` scalar, in 8 shards with an index; no weight tensors.
Baseline: opening every shard and listing its header (``safe_open(...).keys()``), the least a
tool that looks at the checkpoint at all must do.
"""

from __future__ import annotations

import json
import math
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from benchmarks.rows import Row

PROJS = ("gate_proj", "up_proj", "down_proj")


def write_index(root: Path, *, layers: range, experts: int, shards: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for li in layers:
        spread = 1.5 + 2.5 * rng.random()  # 1.5x..4x per layer
        w13 = np.exp(rng.random(experts) * math.log(spread)) / 448.0
        w2 = np.exp(rng.random(experts) * math.log(spread)) / 64.0
        for e in range(experts):
            p = f"model.layers.{li}.mlp.experts.{e}"
            for proj, v in (("gate_proj", w13[e]), ("up_proj", w13[e]), ("down_proj", w2[e])):
                tensors[f"{p}.{proj}.input_scale"] = np.array(v, dtype=np.float32)
                tensors[f"{p}.{proj}.weight_scale_2"] = np.array(1e-3, dtype=np.float32)
    names = list(tensors)
    per = -(-len(names) // shards)
    weight_map = {}
    for k in range(shards):
        shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        part = names[k * per:(k + 1) * per]
        save_file({n: tensors[n] for n in part}, str(root / shard))
        weight_map.update({n: shard for n in part})
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "n_routed_experts": experts, "first_k_dense_replace": layers.start,
        "num_hidden_layers": layers.stop}))
    (root / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.23.0"},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
                         "exclude_modules": ["lm_head"]}}))
    return len(names)


def list_headers(root: Path) -> int:
    n = 0
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), framework="np") as h:
            n += len(list(h.keys()))
    return n


def rows(layers: range = range(3, 61), experts: int = 256, shards: int = 8,
         repeats: int = 3) -> list[Row]:
    from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint

    with tempfile.TemporaryDirectory(prefix="fp4moe-bench-audit-") as tmp:
        root = Path(tmp)
        count = write_index(root, layers=layers, experts=experts, shards=shards)
        t_audit, t_list = [], []
        for _ in range(repeats):  # interleaved; first round warms the page cache for both
            t0 = time.perf_counter()
            report = audit_checkpoint(root)
            t_audit.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            listed = list_headers(root)
            t_list.append(time.perf_counter() - t0)
    a, b = min(t_audit), min(t_list)
    return [Row(5, f"audit, {len(layers)} layers x {experts} experts", "s", a, b,
                "list safetensors headers", "< 5 s", a < 5.0,
                {"scale_tensors_in_index": count, "listed": listed,
                 "scale_tensors_read": report["num_scale_tensors_read"],
                 "layers_audited": len(report["layers"]), "note": f"best of {repeats}"})]
