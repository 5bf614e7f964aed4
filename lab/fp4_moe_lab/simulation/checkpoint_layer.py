# SPDX-License-Identifier: Apache-2.0
"""A real checkpoint's MoE layer as the simulated layer (``Scenario(checkpoint=DIR, layer=N)``).

What a quantizer really wrote -- llmcompressor's uncalibrated experts included -- goes through
the same real vLLM layers and references as the synthetic fixtures. The layer is loaded with the
file's own tensors; the references use the layer a correct loader computes with: uncalibrated
experts (``scale_rule.uncalibrated_experts``) at the calibrated experts' max amax, every other
value as stored.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from fp4_moe_lab.checkpoint.expert_tensors import INPUT_SCALE_SUFFIX, experts_from_tensors
from fp4_moe_lab.nvfp4 import QuantizedExperts
from vllm_fp4_moe_plugin.scales.scale_rule import uncalibrated_experts
from vllm_fp4_moe_plugin.tools.checkpoint.tensor_index import tensor_files

PREFIX = "model.layers.{layer}.mlp.experts"


@functools.lru_cache(maxsize=8)
def read_layer(path: str, layer: int) -> tuple[str, dict, int]:
    """(format, {name relative to the layer's experts: tensor}, number of experts)."""
    prefix = PREFIX.format(layer=layer)
    files = {n: f for n, f in tensor_files(path).items() if n.startswith(prefix + ".")}
    if not files:
        raise ValueError(f"{path}: no tensors under {prefix}")
    from safetensors import safe_open

    tensors = {}
    for f in sorted(set(files.values())):
        with safe_open(str(f), framework="pt") as handle:
            tensors.update({n[len(prefix) + 1:]: handle.get_tensor(n)
                            for n in files if files[n] == f})
    fmt = ("compressed-tensors" if any(n.endswith(".weight_packed") for n in tensors)
           else "modelopt")
    num_experts = 1 + max(int(n.split(".", 1)[0]) for n in tensors)
    return fmt, tensors, num_experts


def stored_experts(path: str, layer: int) -> tuple[str, QuantizedExperts]:
    fmt, tensors, n = read_layer(path, layer)
    return fmt, experts_from_tensors({f"x.{k}": v for k, v in tensors.items()}, fmt, "x", n)


def _repaired(gs: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """gs (2688 / amax) with uncalibrated experts at the calibrated experts' max amax."""
    amax = [float("inf") if v == 0 else 1.0 / v for v in gs.tolist()]
    bad = uncalibrated_experts(amax)
    good = [e for e in range(len(amax)) if e not in bad]
    out = gs.clone()
    if bad and good:
        out[bad] = gs[good].min()
    return out, bad


def reference_experts(path: str, layer: int, ep_size: int = 1) -> QuantizedExperts:
    """The stored experts with uncalibrated ones repaired as the plugin does: over the whole
    layer in every layout (a compressed-tensors rank, which loads only its local experts'
    scales, judges and repairs them with the EP group). ``ep_size`` changes nothing."""
    _, experts = stored_experts(path, layer)
    return dataclasses.replace(experts, w13_input_gs=_repaired(experts.w13_input_gs)[0],
                               w2_input_gs=_repaired(experts.w2_input_gs)[0])


def uncalibrated(path: str, layer: int) -> dict[str, list[int]]:
    """{"w13": experts, "w2": experts} judged as the plugin judges them."""
    _, experts = stored_experts(path, layer)
    return {"w13": _repaired(experts.w13_input_gs)[1], "w2": _repaired(experts.w2_input_gs)[1]}


def overrides(path: str, layer: int, fmt: str, prefix: str) -> dict[str, torch.Tensor]:
    """The file's own activation-scale tensors, renamed to ``prefix``: the layer loads exactly
    what was written (the references' repaired values are for the references only)."""
    stored_fmt, tensors, _ = read_layer(path, layer)
    if fmt != stored_fmt:
        raise ValueError(f"{Path(path).name} is a {stored_fmt} checkpoint; run it as {stored_fmt}")
    suffix = "." + INPUT_SCALE_SUFFIX[fmt]
    return {f"{prefix}.{k}": v.clone() for k, v in tensors.items() if k.endswith(suffix)}
