# SPDX-License-Identifier: Apache-2.0
"""One MoE layer's experts as the checkpoint tensors vLLM 0.11.0 loads, in either format.

The same numbers serve both formats; only names and the direction of the global scales differ
(docs/NVFP4-FORMAT.md §1.3, §2, §3.5):

============================  ==========================  =================================
quantity                      ModelOpt (``modelopt``)      compressed-tensors
============================  ==========================  =================================
packed codes                  ``<proj>.weight``            ``<proj>.weight_packed``
block scales (linear, e4m3)   ``<proj>.weight_scale``      ``<proj>.weight_scale``
weight per-tensor             ``weight_scale_2 = 1/gs_w``  ``weight_global_scale = gs_w``
activation per-tensor         ``input_scale = 1/gs_a``     ``input_global_scale = gs_a``
============================  ==========================  =================================
"""

from __future__ import annotations

import torch

from fp4_moe_lab.nvfp4 import QuantizedExperts

FORMATS = ("modelopt", "compressed-tensors")
# HF projection names -> vLLM FusedMoE shard ids (layer.py make_expert_params_mapping).
PROJECTIONS = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"unknown checkpoint format {fmt!r}; expected one of {FORMATS}")


def _gated(experts: QuantizedExperts, e: int) -> dict:
    return {
        "gate_proj": (experts.w1[e], experts.w1_sf[e], experts.w13_weight_gs[e],
                      experts.w13_input_gs[e]),
        "up_proj": (experts.w3[e], experts.w3_sf[e],
                    (experts.w13_weight_gs if experts.w3_weight_gs is None
                     else experts.w3_weight_gs)[e], experts.w13_input_gs[e]),
        "down_proj": (experts.w2[e], experts.w2_sf[e], experts.w2_weight_gs[e],
                      experts.w2_input_gs[e]),
    }


def expert_tensors(experts: QuantizedExperts, fmt: str, prefix: str) -> dict[str, torch.Tensor]:
    """``{checkpoint_name: tensor}`` for every expert of one layer (``prefix.3.up_proj.weight``)."""
    _check_format(fmt)
    ct = fmt == "compressed-tensors"
    out: dict[str, torch.Tensor] = {}
    for e in range(experts.num_experts):
        if not experts.gated:  # Nemotron-H: up_proj (vLLM's one w13 shard) and down_proj
            per_proj = {
                "up_proj": (experts.w1[e], experts.w1_sf[e], experts.w13_weight_gs[e],
                            experts.w13_input_gs[e]),
                "down_proj": (experts.w2[e], experts.w2_sf[e], experts.w2_weight_gs[e],
                              experts.w2_input_gs[e])}
        else:
            per_proj = _gated(experts, e)
        for proj, (packed, sf, wgs, igs) in per_proj.items():
            base = f"{prefix}.{e}.{proj}"
            wgs = wgs.float().reshape(())
            igs = igs.float().reshape(())
            if ct:
                out[f"{base}.weight_packed"] = packed.contiguous()
                out[f"{base}.weight_scale"] = sf.contiguous()
                out[f"{base}.weight_global_scale"] = wgs.reshape(1)
                out[f"{base}.input_global_scale"] = igs.reshape(1)
            else:
                out[f"{base}.weight"] = packed.contiguous()
                out[f"{base}.weight_scale"] = sf.contiguous()
                out[f"{base}.weight_scale_2"] = 1.0 / wgs
                out[f"{base}.input_scale"] = 1.0 / igs
    return out


def experts_from_tensors(tensors, fmt: str, prefix: str, num_experts: int) -> QuantizedExperts:
    """The inverse of :func:`expert_tensors`: one layer's experts from checkpoint tensors
    (``tensors[name]`` -> torch tensor), e.g. what llmcompressor wrote. Gate and up may each
    have their own weight global scale (``w3_weight_gs``); GEMM1's activation scale per expert
    is the larger amax of gate and up, as vLLM keeps it. Values are taken as stored: an
    uncalibrated expert's 0 or 1e-29 stays (``scale_rule.uncalibrated_experts`` judges it)."""
    _check_format(fmt)
    ct = fmt == "compressed-tensors"
    names = (("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale") if ct
             else ("weight", "weight_scale", "weight_scale_2", "input_scale"))

    def leaf(e: int, proj: str, i: int) -> torch.Tensor:
        return tensors[f"{prefix}.{e}.{proj}.{names[i]}"]

    def gs(e: int, proj: str, i: int) -> torch.Tensor:  # compressed-tensors sense: 2688 / amax
        v = leaf(e, proj, i).float().reshape(())
        return v if ct else 1.0 / v

    def stack(proj: str, i: int) -> torch.Tensor:
        return torch.stack([leaf(e, proj, i) for e in range(num_experts)])

    w13_weight_gs = [gs(e, "gate_proj", 2) for e in range(num_experts)]
    w3_weight_gs = [gs(e, "up_proj", 2) for e in range(num_experts)]
    split = any(not torch.equal(g, u) for g, u in zip(w13_weight_gs, w3_weight_gs))
    return QuantizedExperts(
        w1=stack("gate_proj", 0), w1_sf=stack("gate_proj", 1),
        w3=stack("up_proj", 0), w3_sf=stack("up_proj", 1),
        w2=stack("down_proj", 0), w2_sf=stack("down_proj", 1),
        w13_weight_gs=torch.stack(w13_weight_gs),
        w2_weight_gs=torch.stack([gs(e, "down_proj", 2) for e in range(num_experts)]),
        w13_input_gs=torch.stack([torch.minimum(gs(e, "gate_proj", 3), gs(e, "up_proj", 3))
                                  for e in range(num_experts)]),
        w2_input_gs=torch.stack([gs(e, "down_proj", 3) for e in range(num_experts)]),
        w3_weight_gs=torch.stack(w3_weight_gs) if split else None)


# Per-tensor activation scale, by format: ModelOpt stores ``amax/2688``, compressed-tensors the
# reciprocal ``2688/amax`` (docs/NVFP4-FORMAT.md §3.5).
INPUT_SCALE_SUFFIX = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}
GEMM1_PROJECTIONS = ("gate_proj", "up_proj")


def input_scale_name(fmt: str, prefix: str, expert: int, proj: str) -> str:
    """Checkpoint name of one expert projection's activation scale, e.g.
    ``model.layers.1.mlp.experts.3.up_proj.input_global_scale``."""
    _check_format(fmt)
    return f"{prefix}.{expert}.{proj}.{INPUT_SCALE_SUFFIX[fmt]}"


def stored_input_scale_tensors(fmt: str, prefix: str, w13: torch.Tensor,
                               w2: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` for the activation scales of every expert, given as the values the
    file stores (``input_scale`` for ModelOpt, ``input_global_scale`` for compressed-tensors).

    Why next to :func:`expert_tensors`: that function derives ModelOpt's ``input_scale`` as
    ``1 / gs`` in fp32, which can move a value by one ulp; a writer that promises exact ratios
    between experts' stored scales overrides those entries with these. Gate and up share the
    GEMM1 value (vLLM keeps one per expert, layer.py:1482-1497)."""
    _check_format(fmt)
    w13 = w13.detach().float().reshape(-1)
    w2 = w2.detach().float().reshape(-1)
    if w13.shape != w2.shape:
        raise ValueError(f"{prefix}: {w13.numel()} GEMM1 but {w2.numel()} GEMM2 input scales")
    shape = (1,) if fmt == "compressed-tensors" else ()
    out: dict[str, torch.Tensor] = {}
    for e in range(w13.numel()):
        for proj in GEMM1_PROJECTIONS:
            out[input_scale_name(fmt, prefix, e, proj)] = w13[e].clone().reshape(shape)
        out[input_scale_name(fmt, prefix, e, "down_proj")] = w2[e].clone().reshape(shape)
    return out
