# SPDX-License-Identifier: Apache-2.0
"""Tiny, deterministic NVFP4 MoE checkpoints that vLLM 0.11.0 loads unchanged.

Why hand-written (docs/NVFP4-FORMAT.md §4b): ModelOpt needs a GPU and llm-compressor pins clash with
vLLM 0.11.0, and neither lets a test choose the one thing the bug depends on -- every expert's
GEMM1 activation scale. Here max/min of those scales is exactly ``input_scale_spread`` per layer.

Only routed experts are NVFP4 (see :mod:`.configs`); the rest is bf16. The NVFP4 numbers come
from :mod:`fp4_moe_lab.nvfp4` and the tensor names from :mod:`.expert_tensors`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zlib
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file

from fp4_moe_lab.nvfp4 import E4M3_MAX, FP4_MAX, quantize_experts, random_master

from . import configs
from .expert_tensors import FORMATS, INPUT_SCALE_SUFFIX, expert_tensors, stored_input_scale_tensors
from .writer_limits import (  # noqa: F401  (re-exported: the writer's public limits)
    MAX_CHECKPOINT_BYTES,
    MAX_INPUT_SCALE_SPREAD,
    OWN_FILES,
    is_own_file,
    output_dir_problem,
)

# Which quantize() operation order each format's real exporter uses (nvfp4/quantize.py):
# compressed-tensors is reproduced bit-exactly; ModelOpt's own order is not implemented there,
# the kernel order is the closest (they differ on ~0.1 % of codes, docs/NVFP4-FORMAT.md §3.6).
CONVENTION = {"modelopt": "flashinfer", "compressed-tensors": "compressed_tensors"}

# Activation scales (ModelOpt sense, amax/2688) of the expert with the smallest scale. Powers of
# two, so anchor * spread is exact in fp32. GEMM2's are 2^7 larger (SwiGLU outputs dwarf the
# normed hidden states), so no GEMM2 scale equals a GEMM1 scale.
W13_ANCHOR = 2.0 ** -3  # activation amax 336
W2_ANCHOR = 2.0 ** 4  # activation amax 43008

WEIGHT_STD = 0.02  # bf16 masters: the configs' initializer_range


def _generator(seed: int, name: str) -> torch.Generator:
    """One RNG stream per (seed, tensor group): a tensor's values do not depend on which other
    tensors exist, so changing one size leaves unrelated tensors unchanged."""
    return torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))


def _bf16(shape, seed: int, name: str, *, std: float = WEIGHT_STD, mean: float = 0.0):
    return (torch.randn(*shape, generator=_generator(seed, name)) * std + mean).to(torch.bfloat16)


def _spread_multipliers(gen: torch.Generator, n: int, spread: float) -> torch.Tensor:
    """fp32 ``[n]`` in ``[1, spread]``, log-spaced, randomly assigned to experts, with 1 and
    ``spread`` hit exactly (so max/min == spread) and, for spread > 1, all distinct."""
    if n == 1 or spread == 1.0:
        return torch.ones(n, dtype=torch.float32)
    t = torch.randperm(n, generator=gen).double() / (n - 1)
    r = torch.exp(t * math.log(spread)).float()
    r[t == 0] = 1.0
    r[t == 1] = spread
    return r


def _stored_scales(fmt: str, multipliers: torch.Tensor, anchor: float,
                   spread: float) -> torch.Tensor:
    """The per-expert values the file stores, with max/min == spread exactly in that quantity.

    ModelOpt stores ``anchor * r`` (amax-like). compressed-tensors stores the reciprocal sense,
    ``G * (spread / r)`` with ``G`` the power of two nearest ``1 / (anchor * spread)``: its
    extremes are ``G`` and ``G * spread`` (exact), and for power-of-two spreads it is the
    correctly rounded ``1 / (anchor * r)`` -- the same model as the ModelOpt file.
    """
    if fmt == "modelopt":
        return multipliers * anchor
    g = 2.0 ** round(math.log2(1.0 / (anchor * spread)))
    return (spread / multipliers.double()).float() * g


def _amax_like(fmt: str, stored: torch.Tensor) -> torch.Tensor:
    """ModelOpt-sense activation scale (what GEMM1/GEMM2 dequantize with), float64."""
    s = stored.double()
    return s if fmt == "modelopt" else 1.0 / s


def _check_arguments(fmt, arch, spread, shard_size_bytes) -> float:
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format fmt={fmt!r}; expected one of {FORMATS}")
    configs.check_arch(arch)
    if shard_size_bytes is not None and (not isinstance(shard_size_bytes, int)
                                         or shard_size_bytes <= 0):
        raise ValueError(f"shard_size_bytes={shard_size_bytes!r} must be a positive int or None")
    spread = float(spread)
    if not math.isfinite(spread) or spread < 1.0:
        raise ValueError(f"input_scale_spread={spread!r} must be a finite number >= 1 "
                         "(it is max/min of the experts' scales)")
    if spread > MAX_INPUT_SCALE_SPREAD:
        raise ValueError(
            f"input_scale_spread={spread!r} exceeds {MAX_INPUT_SCALE_SPREAD:g} (448 / 2^-9): the "
            "expert with the largest input scale would quantize every activation block to an "
            "FP8-E4M3 block scale of 0, which no calibrated checkpoint holds")
    spread32 = float(torch.tensor(spread, dtype=torch.float32))
    if spread32 != spread:
        raise ValueError(
            f"input_scale_spread={spread!r} is not exactly representable in float32, so "
            f"max/min of the written fp32 scales cannot equal it; use {spread32!r} or a "
            "value with a short binary fraction (e.g. 1.125, 2.5, 3.0)")
    return spread


def _check_sizes(arch: str, cfg: dict) -> None:
    e = cfg[configs.NUM_EXPERTS_KEY[arch]]
    for key, value in cfg.items():
        base = configs.BASE_CONFIGS[arch][key]
        if isinstance(base, int) and not isinstance(base, bool) and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{key}={value!r} must be a non-negative integer")
    for key in ("hidden_size", "moe_intermediate_size"):
        if cfg[key] <= 0 or cfg[key] % 16:
            raise ValueError(f"{key}={cfg[key]} must be a positive multiple of 16 (NVFP4 "
                             "blocks); vLLM's SM100 MoE kernels also need multiples of 256")
    if e < 1 or not 1 <= cfg["num_experts_per_tok"] <= e:
        raise ValueError(f"need 1 <= num_experts_per_tok={cfg['num_experts_per_tok']} <= "
                         f"{configs.NUM_EXPERTS_KEY[arch]}={e}")
    if arch == "deepseek_v3" and e % cfg["n_group"]:
        raise ValueError(f"n_routed_experts={e} must be divisible by n_group={cfg['n_group']} "
                         "(grouped top-k, vllm/.../fused_moe/fused_moe.py:1034-1094)")
    if not configs.moe_layer_indices(arch, cfg):
        raise ValueError(f"{arch} config with these overrides has no MoE layer "
                         f"(num_hidden_layers={cfg['num_hidden_layers']})")
    for key in ("vocab_size", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        if cfg[key] < 1:
            raise ValueError(f"{key}={cfg[key]} must be >= 1")
    h, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    moe_bytes = len(configs.moe_layer_indices(arch, cfg)) * e * 3 * h * i * (0.5 + 1 / 16)
    dense_bytes = cfg["num_hidden_layers"] * 4 * h * (h + cfg["intermediate_size"]) * 2
    estimate = moe_bytes + dense_bytes + 2 * cfg["vocab_size"] * h * 2
    if estimate > MAX_CHECKPOINT_BYTES:
        raise ValueError(
            f"these sizes would write about {estimate / 1024 ** 3:.1f} GiB; this writer makes "
            f"tiny test checkpoints (at most {MAX_CHECKPOINT_BYTES // 1024 ** 3} GiB): lower "
            "hidden_size, moe_intermediate_size, the number of experts or of layers")


def check_request(*, fmt: str, arch: str, input_scale_spread: float = 4.0,
                  shard_size_bytes: Optional[int] = None, **size_overrides) -> dict:
    """Validate :func:`write_checkpoint`'s arguments without building a tensor; return the
    config.json it would write. Raises ValueError naming the argument."""
    spread = _check_arguments(fmt, arch, input_scale_spread, shard_size_bytes)
    cfg = configs.model_config(arch, size_overrides)
    _check_sizes(arch, cfg)
    if spread != 1.0 and cfg[configs.NUM_EXPERTS_KEY[arch]] < 2:
        raise ValueError("input_scale_spread != 1 needs at least 2 experts")
    return cfg


def _attention_tensors(arch: str, cfg: dict, p: str, seed: int) -> dict:
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if arch == "deepseek_v3":  # MLA, q_lora_rank set (deepseek_v2.py DeepseekV2MLAAttention)
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        kv, q = cfg["kv_lora_rank"], cfg["q_lora_rank"]
        shapes = {"q_a_proj": (q, h), "q_b_proj": (heads * qk, q),
                  "kv_a_proj_with_mqa": (kv + cfg["qk_rope_head_dim"], h),
                  "kv_b_proj": (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kv),
                  "o_proj": (h, heads * cfg["v_head_dim"])}
        norms = {"q_a_layernorm": q, "kv_a_layernorm": kv}
    else:  # Qwen3-MoE: GQA with per-head q/k RMSNorm
        d, kvh = cfg["head_dim"], cfg["num_key_value_heads"]
        shapes = {"q_proj": (heads * d, h), "k_proj": (kvh * d, h), "v_proj": (kvh * d, h),
                  "o_proj": (h, heads * d)}
        norms = {"q_norm": d, "k_norm": d}
    out = {f"{p}.{n}.weight": _bf16(s, seed, f"{p}.{n}") for n, s in shapes.items()}
    out.update({f"{p}.{n}.weight": _bf16((s,), seed, f"{p}.{n}", std=0.05, mean=1.0)
                for n, s in norms.items()})
    return out


def _bf16_mlp(p: str, hidden: int, inter: int, seed: int) -> dict:
    return {f"{p}.gate_proj.weight": _bf16((inter, hidden), seed, f"{p}.gate_proj"),
            f"{p}.up_proj.weight": _bf16((inter, hidden), seed, f"{p}.up_proj"),
            f"{p}.down_proj.weight": _bf16((hidden, inter), seed, f"{p}.down_proj")}


def draw_experts(fmt: str, prefix: str, seed: int, spread: float, e: int, h: int, i: int,
                 *, gated: bool = True):
    """One MoE layer's NVFP4 experts as the writers draw them (masters from ``(seed, prefix)``,
    per-expert stored input scales with max/min == ``spread``): ``(experts, s13, s2, a13,
    a2)``, the stored scales and their ModelOpt-sense values. ``gated=False``: one GEMM1
    projection (non-gated experts)."""
    gen = _generator(seed, prefix)
    w1 = random_master((e, i, h), gen=gen)
    w3 = random_master((e, i, h), gen=gen) if gated else None
    w2 = random_master((e, h, i), gen=gen)
    s13 = _stored_scales(fmt, _spread_multipliers(gen, e, spread), W13_ANCHOR, spread)
    s2 = _stored_scales(fmt, _spread_multipliers(gen, e, spread), W2_ANCHOR, spread)
    a13, a2 = _amax_like(fmt, s13), _amax_like(fmt, s2)
    experts = quantize_experts(w1, w3, w2, (a13 * E4M3_MAX * FP4_MAX).float(),
                               (a2 * E4M3_MAX * FP4_MAX).float(), convention=CONVENTION[fmt])
    return experts, s13, s2, a13, a2


def _routed_experts(fmt: str, arch: str, cfg: dict, prefix: str, seed: int,
                    spread: float) -> tuple[dict, dict]:
    """One MoE layer's expert tensors and its manifest entry."""
    e, h, i = cfg[configs.NUM_EXPERTS_KEY[arch]], cfg["hidden_size"], cfg["moe_intermediate_size"]
    experts, s13, s2, a13, a2 = draw_experts(fmt, prefix, seed, spread, e, h, i)
    # Keep the experts object consistent with the file (gs = 1/input_scale in the CT sense).
    gs13, gs2 = (s13, s2) if fmt == "compressed-tensors" else (1.0 / s13, 1.0 / s2)
    experts = dataclasses.replace(experts, w13_input_gs=gs13.float(), w2_input_gs=gs2.float())
    tensors = expert_tensors(experts, fmt, prefix)
    exact = stored_input_scale_tensors(fmt, prefix, s13, s2)
    assert exact.keys() <= tensors.keys(), "input-scale names must match expert_tensors()"
    tensors.update(exact)
    entry = {"layer": prefix, "num_experts": e, "stored_name": INPUT_SCALE_SUFFIX[fmt],
             "w13_stored": s13.tolist(), "w2_stored": s2.tolist(),
             "w13_input_scale": a13.tolist(), "w2_input_scale": a2.tolist(),
             "w13_spread": float(s13.max() / s13.min()),
             "w2_spread": float(s2.max() / s2.min())}
    return tensors, entry


def _model_tensors(fmt: str, arch: str, cfg: dict, seed: int, spread: float):
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    e = cfg[configs.NUM_EXPERTS_KEY[arch]]
    moe = set(configs.moe_layer_indices(arch, cfg))
    tensors = {"model.embed_tokens.weight": _bf16((v, h), seed, "embed_tokens")}
    layers = []
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}"
        tensors.update(_attention_tensors(arch, cfg, f"{p}.self_attn", seed))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"{p}.{norm}.weight"] = _bf16((h,), seed, f"{p}.{norm}", std=0.05, mean=1.0)
        if li not in moe:
            tensors.update(_bf16_mlp(f"{p}.mlp", h, cfg["intermediate_size"], seed))
            continue
        tensors[f"{p}.mlp.gate.weight"] = _bf16((e, h), seed, f"{p}.mlp.gate")
        if arch == "deepseek_v3":
            if cfg["topk_method"] == "noaux_tc":  # fp32 [E] (deepseek_v2.py:163-167)
                tensors[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(
                    e, generator=_generator(seed, f"{p}.bias")) * 0.01
            if cfg.get("n_shared_experts"):
                tensors.update(_bf16_mlp(f"{p}.mlp.shared_experts", h,
                                         cfg["moe_intermediate_size"] * cfg["n_shared_experts"],
                                         seed))
        experts, entry = _routed_experts(fmt, arch, cfg, f"{p}.mlp.experts", seed, spread)
        tensors.update(experts)
        layers.append(entry)
    tensors["model.norm.weight"] = _bf16((h,), seed, "model.norm", std=0.05, mean=1.0)
    tensors["lm_head.weight"] = _bf16((v, h), seed, "lm_head")
    return tensors, layers


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _shards(tensors: dict, shard_size_bytes: Optional[int]) -> list[dict]:
    """Greedy, in insertion order: a new shard starts when the next tensor would overflow."""
    if shard_size_bytes is None:
        return [tensors]
    shards: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + _nbytes(t) > shard_size_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += _nbytes(t)
    return shards


def _prepare_dir(out: Path, overwrite: bool, check_only: bool = False) -> None:
    problem = output_dir_problem(out, overwrite)
    if problem:
        hint = (" (pass overwrite=True to replace it)" if "already holds" in problem else "")
        raise FileExistsError(problem + hint)
    if check_only:
        return
    out.mkdir(parents=True, exist_ok=True)
    ours = [p for p in out.iterdir() if is_own_file(p.name)]
    for p in ours:  # stale shards would be globbed by vLLM's loader next to new ones
        p.unlink()


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def write_checkpoint(out_dir, *, fmt: str, arch: str, seed: int = 0,
                     input_scale_spread: float = 4.0, shard_size_bytes: Optional[int] = None,
                     overwrite: bool = False, **size_overrides) -> dict:
    """Write a tiny NVFP4 MoE checkpoint of ``arch`` ("deepseek_v3" | "qwen3_moe") in ``fmt``
    ("modelopt" | "compressed-tensors") to ``out_dir``; return a JSON-able manifest.

    ``size_overrides`` are config.json keys of the arch (e.g. ``hidden_size=512``,
    ``n_routed_experts=8``). ``shard_size_bytes`` splits the tensors into
    ``model-0000k-of-0000n.safetensors`` + ``model.safetensors.index.json``. Same arguments give
    byte-identical files. Every MoE layer's per-expert GEMM1 and GEMM2 stored input scales have
    max/min == ``input_scale_spread`` exactly; gate and up of an expert share their input scale
    and weight global scale; GEMM1 and GEMM2 scales never coincide.
    """
    cfg = check_request(fmt=fmt, arch=arch, input_scale_spread=input_scale_spread,
                        shard_size_bytes=shard_size_bytes, **size_overrides)
    spread = float(input_scale_spread)
    _prepare_dir(Path(out_dir), overwrite, check_only=True)  # before building any tensor
    tensors, layers = _model_tensors(fmt, arch, cfg, seed, spread)

    out = Path(out_dir)
    _prepare_dir(out, overwrite)
    written: list[Path] = []
    quant = None
    if fmt == "modelopt":
        quant = configs.hf_quant_config(arch, cfg)
        _write_json(out / "hf_quant_config.json", quant)
        written.append(out / "hf_quant_config.json")
    else:
        cfg["quantization_config"] = configs.compressed_tensors_quantization_config(arch, cfg)
    _write_json(out / "config.json", cfg)
    written.append(out / "config.json")

    shards = _shards(tensors, shard_size_bytes)
    names = (["model.safetensors"] if len(shards) == 1 and shard_size_bytes is None else
             [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))])
    weight_map = {}
    for shard, name in zip(shards, names):
        # Own storage per tensor: expert_tensors() hands out views (gate and up even share
        # their weight global scale), which safetensors refuses to serialize.
        own = {k: t.detach().contiguous().clone() for k, t in shard.items()}
        save_file(own, str(out / name), metadata={"format": "pt"})
        written.append(out / name)
        weight_map.update({t: name for t in shard})
    total = sum(_nbytes(t) for t in tensors.values())
    if shard_size_bytes is not None:
        _write_json(out / "model.safetensors.index.json",
                    {"metadata": {"total_size": total},
                     "weight_map": dict(sorted(weight_map.items()))})
        written.append(out / "model.safetensors.index.json")
    return {
        "out_dir": str(out), "format": fmt, "arch": arch, "seed": seed,
        "input_scale_spread": spread, "quantize_convention": CONVENTION[fmt],
        "paths": [str(p) for p in written],
        "files_bytes": {p.name: os.path.getsize(p) for p in written},
        "num_tensors": len(tensors), "tensor_bytes": total,
        "config": cfg, "hf_quant_config": quant, "layers": layers,
    }
