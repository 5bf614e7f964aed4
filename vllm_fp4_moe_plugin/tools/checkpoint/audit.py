# SPDX-License-Identifier: Apache-2.0
"""Is an NVFP4 MoE checkpoint hit by a vLLM release's GEMM1 activation-scale bug? Read only scales.

Stock vLLM quantizes an MoE layer's input with one GEMM1 input scale (0.11.0: expert 0's, or the
quantizing rank's first local expert's; 0.14.0+: the sender's local max) and dequantizes with the
owning expert's (docs/ROOT-CAUSE.md §5, §12), so the scale values (:mod:`.scale_values`)
decide, per layout and EP size, by ``support``'s model of the design. An uncalibrated expert is
a per-layer finding; the layer's other figures are of what the plugin loads."""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional

from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.scales.scale_rule import uncalibrated

from .config_lint import compressed_tensors_011_refuses, transformers4_misreads
from .detect import detect_format
from .scale_values import INPUT_SCALE, WEIGHT_SCALE, is_gated, read_expert_scales
from .tensor_index import CheckpointAuditError, CheckpointError, checkpoint_dir, read_json

LAYOUTS = ("single", "pp", "tp", "tp_ep", "dp_ep_allgather", "dp_ep_all2allv", "dp")
PLACEMENTS = ("linear", "round_robin")


def layouts_judged(design: Design) -> tuple[str, ...]:
    """The report's layout columns: :data:`LAYOUTS`, plus the NVLink one-sided dispatch on the
    design that has it (doctor looks a deployment's layout up here)."""
    return LAYOUTS + (("dp_ep_one_sided",) if design is Design.NVFP4_ORACLE else ())


@contextlib.contextmanager
def _audit_errors() -> Iterator[None]:
    try:
        yield
    except CheckpointAuditError:
        raise
    except CheckpointError as exc:
        raise CheckpointAuditError(str(exc)) from None


def ep_slices(num_experts: int, ep_size: int, placement: str = "linear") -> list[list[int]]:
    """Global expert ids per EP rank as ``determine_expert_map`` assigns them (the same in
    0.11.0, layer.py:818-841, and 0.34.0): :func:`vllm_fp4_moe_plugin.base.support.ep_slices`."""
    if placement not in PLACEMENTS:
        raise ValueError(f"expert placement {placement!r} must be one of {PLACEMENTS}")
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")
    return support.ep_slices(num_experts, ep_size, placement)


def _amax_like(fmt: str, stored: list[float]) -> list[float]:
    """Proportional to the activation amax: ModelOpt's input_scale, 1 / CT's input_global_scale."""
    if fmt != "compressed-tensors":
        return list(stored)
    return [1.0 / v if v else math.inf for v in stored]


def _with_fallback(fmt: str, layer: str, what: str, stored: list[float], bad) -> list[float]:
    """``stored`` with uncalibrated experts given the calibrated max amax, as the plugin loads."""
    good = [v for e, v in enumerate(stored) if e not in bad]
    if not bad:
        return list(stored)
    if not good:
        raise CheckpointAuditError(
            f"{layer}: no expert has a calibrated {what} activation scale, so there is nothing "
            "to fall back on; re-quantize with calibration data that reaches every expert "
            "(llmcompressor: moe_calibrate_all_experts=True)")
    fallback = min(good) if fmt == "compressed-tensors" else max(good)
    return [fallback if e in bad else v for e, v in enumerate(stored)]


def _layer_report(fmt: str, layer: str, shards: list[list[float]], ep_size: int, placement: str,
                  design: Design = Design.INIT_PREPARE_FINALIZE,
                  missing: Optional[dict] = None) -> dict:
    """``shards``: gate, up, down input scales per expert; ``missing``: per GEMM, the experts
    whose input-scale tensor the checkpoint lacks (NaN here; stock: what the memory held)."""
    (gate, up, down), missing = shards, missing or {"w13": [], "w2": []}
    ct = fmt == "compressed-tensors"
    ep_slices(len(gate), ep_size, placement)  # placement and EP size, checked with audit's words
    # judged on gate and up each; both get the fallback (their stored values differ)
    bad13 = uncalibrated(list(zip(_amax_like(fmt, gate), _amax_like(fmt, up))),
                         where=f"{layer}: GEMM1 (gate/up) input scales")
    bad2 = uncalibrated(_amax_like(fmt, list(down)),
                        where=f"{layer}: GEMM2 (down_proj) input scales")
    gate_used = _with_fallback(fmt, layer, "GEMM1 (gate/up)", list(gate), bad13)
    up_used = _with_fallback(fmt, layer, "GEMM1 (gate/up)", list(up), bad13)
    down_used = _with_fallback(fmt, layer, "GEMM2 (down_proj)", list(down), bad2)
    kinds = sorted(set(bad13.values()) | set(bad2.values()))
    # vLLM keeps one GEMM1 scale per expert: .max() over gate/up of the *stored* quantity
    # (modelopt.py:1307-1308, compressed_tensors_moe.py:300-301).
    w13_raw = [max(g, u) for g, u in zip(gate, up)]
    w13 = [max(g, u) for g, u in zip(gate_used, up_used)]
    # in_scale[e] / in_scale[0], from the stored values without a reciprocal
    factors = [w13[0] / v if ct else v / w13[0] for v in w13]
    # 0.14.0+: the activation amax per expert, max over gate/up (v0.34.0 CT w4a4_nvfp4.py:242,
    # 1 / input_global_scale; ModelOpt's input_scale is already an amax-like scale).
    amax = _amax_like(fmt, w13)
    calibrated_gate_up = [v for e, (g, u) in enumerate(zip(gate, up)) if e not in bad13
                          for v in (g, u)]
    uniform = len(set(calibrated_gate_up)) <= 1
    by_scales = support.stock_wrong_with_scales(design, fmt, w13, amax, ep_size, placement,
                                                layouts_judged(design))
    by_uncalibrated = (support.stock_wrong_with_uncalibrated(design, fmt, kinds)
                       or bool(missing["w13"] or missing["w2"]))
    report = {
        "layer": layer, "num_experts": len(w13), "stored_name": INPUT_SCALE[fmt],
        "w13_stored": w13_raw, "w2_stored": list(down),
        "w13_input_scale": amax, "w2_input_scale": _amax_like(fmt, down_used),
        # max/min is invariant under the reciprocal, so take it from the stored values (exact).
        "w13_spread": max(w13) / min(w13), "w2_spread": max(down_used) / min(down_used),
        "reference_expert": 0, "error_factor_max": max(factors), "error_factor_min": min(factors),
        "gate_up_mismatch": [e for e, (g, u) in enumerate(zip(gate, up))
                             if g != u and e not in bad13],
        # all-experts calibration shows every expert the same tokens: identical gate/up scales
        "calibration": "all-experts" if uniform else "routed",
        "uncalibrated_w13": sorted(bad13), "uncalibrated_w2": sorted(bad2),
        "uncalibrated_kinds": kinds, "missing_w13": missing["w13"], "missing_w2": missing["w2"],
        "stock_wrong_uncalibrated": by_uncalibrated,
        # An uncalibrated expert that stock uses is wrong in every layout (none re-scales it).
        "affected": {lay: hit or by_uncalibrated for lay, hit in by_scales.items()},
        "affected_by_scales": by_scales,  # the design's hole alone (the calibrated scales)
        "layout_problem": (support.ep_layout_problem(len(w13), ep_size, placement)
                           if design is Design.INIT_PREPARE_FINALIZE else None)}
    if design is Design.NVFP4_ORACLE:
        report["ep_rank_max_amax"] = support.rank_local_maxima(amax, ep_size, placement)
        report["dp_ep_off_by"] = support.stock_dp_ep_off_by(amax, ep_size, placement) if ct else 1.0
    return report


def _weight_name(fmt: str, input_name: str) -> str:
    return input_name[: -len(INPUT_SCALE[fmt])] + WEIGHT_SCALE[fmt]


def gate_up_weights(entry: dict, fmt: str, shards: list[list]) -> None:
    """Add to a layer's report the experts whose gate and up weight global scales differ, the
    worst factor stock is off by, and mark every layout affected (no layout re-scales them)."""
    gate, up = ([math.nan if v is None else (1.0 / v if fmt == "modelopt" else v) for v in s]
                for s in shards)
    split = support.gate_up_split(gate, up)
    entry["weight_gate_up_split"] = sorted(split)
    entry["weight_gate_up_worst"] = max((max(f, 1 / f) for f in split.values()), default=1.0)
    if split:
        entry["affected"] = {lay: True for lay in entry["affected"]}


def _summary(layers: list[dict], design: Design = Design.INIT_PREPARE_FINALIZE,
             ep_size: int = 2) -> str:
    """The verdict: split gate/up weight scales and uncalibrated experts first, then the
    design's hole."""
    verdict = _uncalibrated_summary(layers, design, ep_size)
    split = [e for e in layers if e.get("weight_gate_up_split")]
    if not split:
        return verdict
    worst = max(split, key=lambda e: e["weight_gate_up_worst"])
    n = sum(len(e["weight_gate_up_split"]) for e in split)
    return (f"AFFECTED: gate and up weight global scales differ for {n} expert(s) in "
            f"{len(split)} layer(s), up to {worst['weight_gate_up_worst']:.4g}x in "
            f"{worst['layer']}: vLLM {support.design(design).releases} keeps the gate's for both "
            "halves, so each such expert's output is off by that factor in every layout; the "
            f"plugin computes each half with its own. Otherwise: {verdict}")


def _uncalibrated_summary(layers: list[dict], design: Design, ep_size: int) -> str:
    """Uncalibrated experts first when stock uses them, then the design's hole."""
    verdict = _hole_summary(layers, design, ep_size)
    uncal = [entry for entry in layers if entry["uncalibrated_w13"] or entry["uncalibrated_w2"]]
    if not uncal:
        return verdict
    n = sum(len(e["uncalibrated_w13"]) + len(e["uncalibrated_w2"]) for e in uncal)
    first = uncal[0]
    where = ", ".join(f"{g} expert(s) {first['uncalibrated_' + g]}" for g in ("w13", "w2")
                      if first["uncalibrated_" + g])
    n_missing = sum(len(e.get("missing_w13", [])) + len(e.get("missing_w2", [])) for e in uncal)
    what = (f"{n} uncalibrated activation scale(s) (no calibration token reached the expert"
            + (f"; {n_missing} of them missing from the checkpoint" if n_missing else "")
            + f") in {len(uncal)} layer(s), first {first['layer']}: {where}")
    releases = support.design(design).releases
    if any(e["stock_wrong_uncalibrated"] for e in uncal):
        return (f"AFFECTED: {what}; stock vLLM {releases} uses them as they are (NaN or wrong "
                "outputs; a missing one: whatever its memory held); the plugin loads the "
                f"calibrated experts' max amax for them. Scales as calibrated: {verdict}")
    return (f"{verdict}; {what}: stock vLLM {releases} ignores them (a max over experts skips a "
            "low amax); the plugin loads the calibrated experts' max amax for them")


def calibration_line(layers: list[dict]) -> str:
    """Which calibration the gate/up input scales show (the all-experts signature: identical)."""
    routed = [e for e in layers if e["calibration"] == "routed"]
    if not routed:
        return (f"calibration: all-experts in all {len(layers)} MoE layer(s) (every expert's "
                "gate/up input scale identical: GEMM1 scale mismatches cannot occur)")
    worst = max(routed, key=lambda e: e["w13_spread"])
    return (f"calibration: routed in {len(routed)} of {len(layers)} MoE layer(s) (gate/up input "
            f"scales spread up to {worst['w13_spread']:.4g}x in {worst['layer']}); all-experts "
            f"(identical) in {len(layers) - len(routed)}")


def _hole_summary(layers: list[dict], design: Design = Design.INIT_PREPARE_FINALIZE,
                  ep_size: int = 2) -> str:
    bad = [entry for entry in layers if any(entry["affected_by_scales"].values())]
    if design is not Design.INIT_PREPARE_FINALIZE:
        releases = support.design(design).releases
        if not bad:
            return (f"not affected: stock vLLM {releases} computes all {len(layers)} MoE "
                    f"layer(s) correctly in every layout judged (EP size {ep_size})")
        where = sorted({lay for entry in bad for lay, hit in entry["affected_by_scales"].items()
                        if hit})
        if design is Design.NVFP4_ORACLE:
            worst = max(bad, key=lambda entry: entry["dp_ep_off_by"])
            how = (f"the EP ranks' local maxima of the GEMM1 input amax differ (worst "
                   f"{worst['layer']}: GEMM1 off by up to {worst['dp_ep_off_by']:.4g}x on tokens "
                   "quantized by another rank)")
        else:
            worst = max(bad, key=lambda entry: entry["w13_spread"])
            how = (f"DP dispatch quantizes with expert 0's scale (worst {worst['layer']}: spread "
                   f"{worst['w13_spread']:.4g}x)")
        return (f"AFFECTED: {len(bad)} of {len(layers)} MoE layer(s) are computed wrongly by stock "
                f"vLLM {releases} in {', '.join(where)}: {how}")
    problem = next((entry["layout_problem"] for entry in layers if entry["layout_problem"]), None)
    if problem:  # every layer, whatever its scales, in the EP layouts
        spread = sum(entry["w13_spread"] != 1.0 for entry in layers)
        return (f"AFFECTED: {len(bad)} of {len(layers)} MoE layer(s) in the EP layouts "
                f"({', '.join(support.EP_LAYOUTS)}): {problem}; {spread} layer(s) also have "
                "unequal per-expert GEMM1 input scales")
    if not bad:
        return (f"not affected: all {len(layers)} MoE layer(s) have equal per-expert GEMM1 input "
                "scales, so stock vLLM 0.11.0 computes them correctly in every layout")
    worst = max(bad, key=lambda entry: entry["w13_spread"])
    return (f"AFFECTED: {len(bad)} of {len(layers)} MoE layer(s) have unequal per-expert GEMM1 "
            f"input scales (worst {worst['layer']}: spread {worst['w13_spread']:.4g}x, expert "
            f"outputs off by {worst['error_factor_min']:.4g}x..{worst['error_factor_max']:.4g}x "
            "vs expert 0); stock vLLM 0.11.0's FlashInfer CUTLASS NVFP4 MoE computes them wrongly")


def audit_checkpoint(path, *, ep_size: int = 2, expert_placement: str = "linear",
                     design: Design = Design.INIT_PREPARE_FINALIZE) -> dict:
    """Audit the per-expert activation scales of every NVFP4 MoE layer under ``path``, for the EP
    layouts of ``ep_size`` (DP x TP) and ``design``. Raises :class:`CheckpointAuditError`."""
    design = support.design(design)  # ValueError for an unknown one, before any file is read
    with _audit_errors():
        root = checkpoint_dir(path)
        config = read_json(root / "config.json", what="config.json")
        fmt, source, warnings = detect_format(root, config)
        tokenizer_path = root / "tokenizer_config.json"
        tokenizer = (read_json(tokenizer_path, what="tokenizer_config.json")
                     if tokenizer_path.exists() else None)
        config_warnings = transformers4_misreads(config, tokenizer)
        ct_refuses = compressed_tensors_011_refuses(config)
        warnings += config_warnings + ct_refuses
        plan, values, absent = read_expert_scales(root, config, fmt)
    reports = [_layer_report(fmt, layer, [[values[n] for n in names[shard]] for shard in
                                          ("w1", "w3", "w2")], ep_size, expert_placement, design,
                             missing={g: sorted({e for shard in shards
                                                 for e, n in enumerate(names[shard])
                                                 if n in absent})
                                      for g, shards in (("w13", ("w1", "w3")), ("w2", ("w2",)))})
               for layer, names in plan]
    for (_, names), entry in zip(plan, reports):
        entry["gated"] = is_gated(names)  # non-gated: one GEMM1 projection, nothing to split
        gate_up_weights(entry, fmt, [[values.get(_weight_name(fmt, n)) for n in names[shard]]
                                     for shard in ("w1", "w3")])
    for entry in reports:
        if entry["gate_up_mismatch"]:
            warnings.append(
                f"{entry['layer']}: gate and up input scales differ for expert(s) "
                f"{entry['gate_up_mismatch'][:8]}; vLLM keeps one per expert, the max of the "
                "stored values (docs/ROOT-CAUSE.md)")
    by_layout = {lay: sum(entry["affected"][lay] for entry in reports)
                 for lay in layouts_judged(design)}
    return {
        "path": str(root), "format": fmt, "quant_config_source": source, "design": design,
        "architectures": list(config.get("architectures") or []),
        "vllm_releases": support.design(design).releases, "ep_size": ep_size,
        "expert_placement": expert_placement, "num_scale_tensors_read": len(values),
        "layers": reports,
        "affected_layers": sum(any(entry["affected"].values()) for entry in reports),
        "affected_layers_by_layout": by_layout, "warnings": warnings,
        "transformers4_misreads": config_warnings, "compressed_tensors_011_refuses": ct_refuses,
        "non_gated_layers": sum(not entry["gated"] for entry in reports),
        "calibration": calibration_line(reports), "summary": _summary(reports, design, ep_size)}

