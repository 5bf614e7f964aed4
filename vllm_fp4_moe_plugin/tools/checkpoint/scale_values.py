# SPDX-License-Identifier: Apache-2.0
"""The per-expert scale scalars of a checkpoint, and nothing else: shards are opened lazily
(``safe_open``) and only input and weight global scales are read (the plugin refuses a bad one of
either), never weights or block scales, so a DeepSeek-R1-sized index audits in seconds. Each is
judged by the plugin's rule (``scale_rule``): a bad one is a bad checkpoint (an audit error)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path

from vllm_fp4_moe_plugin.scales.scale_rule import InvalidScaleError, check_scale

from .tensor_index import CheckpointAuditError, open_safetensors, tensor_files

INPUT_SCALE = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}
WEIGHT_SCALE = {"modelopt": "weight_scale_2", "compressed-tensors": "weight_global_scale"}
# Checkpoint projection names -> FusedMoE shard; Mixtral-style checkpoints use w1/w3/w2.
PROJECTION_STYLES = ({"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
                     {"w1": "w1", "w3": "w3", "w2": "w2"})
_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.")
# One tensor for all of a layer's experts (Llama-4's and transformers 5's stacked
# ``experts.gate_up_proj``, ``experts.down_proj``): no per-expert scale scalars to read.
_STACKED_TENSOR = re.compile(r"^(?P<layer>.+\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|"
                             r"down_proj|w13|w1|w2|w3)(?=$|[._])")
# config.json keys holding the routed-expert count (DeepSeek, Qwen3-MoE, Mixtral, Llama-4),
# at the top or, for multimodal configs (Llama-4, Qwen3.5), under text_config.
NUM_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _moe_layers(names) -> dict[str, dict]:
    """``{layer prefix: {"experts": ids, "projs": projection names}}`` from tensor names."""
    layers: dict[str, dict] = defaultdict(lambda: {"experts": set(), "projs": set()})
    for name in names:
        m = _EXPERT_TENSOR.match(name)
        if m:
            layers[m["layer"]]["experts"].add(int(m["e"]))
            layers[m["layer"]]["projs"].add(m["proj"])
    return dict(layers)


def _num_experts(config: dict, layer: str, seen: set[int]) -> int:
    text = config.get("text_config")
    text = text if isinstance(text, dict) else {}
    for key in NUM_EXPERTS_KEYS:
        n = config.get(key, text.get(key))
        if isinstance(n, int) and n > 0:
            if max(seen) >= n:
                raise CheckpointAuditError(
                    f"{layer}: tensors of expert {max(seen)} but config.json {key}={n}; fix "
                    f"{key} or remove the extra experts")
            return n
    return max(seen) + 1


def _style(layer: str, projs: set[str]) -> dict[str, str]:
    """The layer's checkpoint names per FusedMoE shard. Gated experts have both GEMM1 halves;
    non-gated ones (Nemotron-H's relu2 experts: ``up_proj`` and ``down_proj``) have one, which
    vLLM loads as its only w13 shard (nemotron_h.py ``get_expert_mapping``), so ``w1`` and
    ``w3`` then name the same tensor."""
    for style in PROJECTION_STYLES:
        if not projs & set(style.values()):
            continue
        halves = [style[s] for s in ("w1", "w3") if style[s] in projs]
        if style["w2"] not in projs or not halves:
            raise CheckpointAuditError(
                f"{layer}: expert projections {sorted(projs)} lack a "
                + ("GEMM1 projection" if not halves else f"down projection ({style['w2']})")
                + "; every expert needs gate and up (or one up) and down tensors")
        if len(halves) == 1:
            return {"w1": halves[0], "w3": halves[0], "w2": style["w2"]}
        return style
    raise CheckpointAuditError(f"{layer}: unrecognised expert projection names {sorted(projs)}")


def is_gated(names: dict) -> bool:
    """A layer of :func:`read_expert_scales`'s plan: gate and up are separate tensors."""
    return names["w1"] != names["w3"]


def _refuse_stacked(root: Path, files) -> None:
    """Stacked expert tensors hold every expert in one tensor: there are no per-expert scale
    scalars to read, so what vLLM computes there is not modelled (say so, do not guess)."""
    stacked = sorted(n for n in files if _STACKED_TENSOR.match(n))
    if stacked:
        layer = stacked[0].rsplit(".experts.", 1)[0] + ".experts"
        raise CheckpointAuditError(
            f"{root}: stacked expert tensors ({stacked[0]}{', ...' if len(stacked) > 1 else ''}"
            f" in {layer}): one tensor for all experts, not experts.E.<projection> per expert. "
            "The audit and the plugin model per-expert NVFP4 scales only, so they cannot tell "
            "what vLLM computes for this layout; export per-expert tensors (ModelOpt and "
            "llmcompressor unpack fused experts) or see docs/SUPPORT.md (families)")


def _read_scalars(names: dict[str, Path]) -> dict[str, float]:
    """``get_tensor`` on exactly these names, one lazy ``safe_open`` per shard; each judged by
    :func:`scale_rule.check_scale` (float, one element; a weight scale also finite and > 0)."""
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name, f in names.items():
        by_file[f].append(name)
    values: dict[str, float] = {}
    dtype_names: dict = {}  # str(numpy dtype) is slow; an R1 index has ~90k scalars
    for f, wanted in sorted(by_file.items()):
        if not f.exists():
            raise CheckpointAuditError(
                f"{f}: shard file missing; the index maps {len(wanted)} scale tensor(s) to it, "
                f"e.g. {wanted[0]}; copy the shard or regenerate the index")
        with open_safetensors(f) as handle:
            for name in wanted:
                activation = _is_input_scale(name)  # its values: judged per layer (uncalibrated)
                try:
                    t = handle.get_tensor(name)
                    dtype = dtype_names.get(t.dtype) or dtype_names.setdefault(t.dtype,
                                                                               str(t.dtype))
                    shape, flat = t.shape, t.reshape(-1).tolist()
                except TypeError:  # e.g. bf16 has no numpy dtype: read this one via torch
                    with open_safetensors(f, framework="pt") as th:
                        t = th.get_tensor(name)
                        dtype, shape = str(t.dtype), list(t.shape)
                        flat = t.float().reshape(-1).tolist() if t.is_floating_point() else []
                except Exception as exc:  # safetensors raises SafetensorError for absent names
                    _refuse_header_dtype(handle, f, name)  # numpy cannot hold e.g. float8
                    raise CheckpointAuditError(
                        f"{f}: cannot read scale tensor {name} ({exc}); the index lists it in "
                        "this shard") from None
                try:
                    check_scale(flat, where=str(f), name=name, dtype=dtype, shape=shape,
                                expect_numel=1, activation=activation)
                except InvalidScaleError as exc:
                    raise CheckpointAuditError(str(exc)) from None
                values[name] = float(flat[0])
    return values


def _refuse_header_dtype(handle, f: Path, name: str) -> None:
    """Numpy could not read it: refuse a header dtype a global scale may not have (float8, say)."""
    try:
        dtype = handle.get_slice(name).get_dtype()
    except Exception:  # absent name: the caller's message says so
        return
    try:
        check_scale([], where=str(f), name=name, dtype=dtype)
    except InvalidScaleError as exc:
        raise CheckpointAuditError(str(exc)) from None


def _is_input_scale(name: str) -> bool:
    return name.endswith(tuple("." + v for v in INPUT_SCALE.values()))


def read_expert_scales(root: Path, config: dict, fmt: str) -> tuple[list, dict, set]:
    """``(plan, values, absent)``: per MoE layer in natural order ``(layer, {shard: input-scale
    names})``; every scale read, by name; the input-scale names absent (NaN in ``values``)."""
    files = tensor_files(root)
    _refuse_stacked(root, files)
    layers = _moe_layers(files)
    if not layers:
        raise CheckpointAuditError(f"{root}: no routed-expert tensors (names like "
                                   "model.layers.N.mlp.experts.E.gate_proj.*); nothing to audit")
    wanted: dict[str, Path] = {}
    absent: set[str] = set()
    plan = []
    for layer in sorted(layers, key=_natural_key):
        info = layers[layer]
        style = _style(layer, info["projs"])
        n = _num_experts(config, layer, info["experts"])
        names = {shard: [f"{layer}.{e}.{style[shard]}.{INPUT_SCALE[fmt]}" for e in range(n)]
                 for shard in ("w1", "w3", "w2")}
        for shard_names in names.values():
            for e, name in enumerate(shard_names):
                base = name[: -len(INPUT_SCALE[fmt])]
                weight = base + WEIGHT_SCALE[fmt]
                has_weight = base + "weight" in files or base + "weight_packed" in files
                if weight not in files and has_weight:
                    raise CheckpointAuditError(
                        f"{layer}: expert {e} has no weight scale tensor {weight} in {root}; its "
                        "NVFP4 weights cannot be dequantized -- re-export the checkpoint")
                if weight in files:
                    wanted[weight] = files[weight]
                if name not in files:  # an uncalibrated expert (vllm#45212), not corruption
                    absent.add(name)
                    continue
                wanted[name] = files[name]
        plan.append((layer, names))
    values = _read_scalars(wanted)
    values.update({name: math.nan for name in absent})  # as the plugin sees it: no value
    return plan, values, absent
