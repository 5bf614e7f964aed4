"""Is an NVFP4 MoE checkpoint hit by a vLLM release's GEMM1 activation-scale bug? Read only scales.

``design`` picks the release's semantics (``support.Design``; the default,
init_prepare_finalize, is vLLM 0.11.0's, described first):

Stock 0.11.0 pre-quantizes every FlashInfer CUTLASS MoE input with ONE expert's GEMM1 input scale
(expert 0, or the first local expert of the quantizing rank) but dequantizes with each expert's
own, so expert e's output is off by ``in_scale[e] / in_scale[e0]`` (docs/ROOT-CAUSE.md §5).
GEMM2 is always consistent. So a layer is computed wrongly iff its experts' GEMM1 input scales
differ, and a checkpoint can be judged from those scalars alone: this module opens each shard
lazily (``safe_open``) and calls ``get_tensor`` on the per-expert global scales only (input
scales, and the weight global scales the plugin also validates) -- never on
``weight``/``weight_packed``/``weight_scale`` -- so a DeepSeek-R1-sized index audits in seconds.
Every scale read is judged by the plugin's own rule (``scale_check``): a bad one is a bad
checkpoint (:class:`CheckpointAuditError`), not a finding. An *uncalibrated* expert (an input
scale that no calibration could have produced, ``scale_check.uncalibrated``) is a finding:
reported per layer with what stock does with it on the judged release
(``support.stock_wrong_with_uncalibrated``), while the layer's other figures are of what the
plugin loads (the calibrated experts' max amax for it). Each layer also shows its calibration's
signature: all-experts calibration leaves every gate/up input scale identical, routed
calibration spreads them. Config keys that transformers 4 reads under other names than
transformers 5 writes are named with the key to add (:func:`transformers4_misreads`).

"affected", per layout (``LAYOUTS``), is computed exactly for stock 0.11.0 at the given EP size:

* single, pp, tp, dp: quantized with expert 0's scale -> affected iff not all scales are equal.
* dp_ep_allgather, dp_ep_all2allv: quantized on the *sender* with its first local expert's
  scale, dequantized on any receiver -> affected iff not all scales are equal.
* tp_ep: each rank quantizes its own tokens with its first local expert's scale -> affected iff
  some rank's slice (vLLM's ``determine_expert_map``, layer.py:786-846) is not uniform.
* every EP layout, whatever the scales, when the experts do not split into equal contiguous
  blocks (``round_robin`` placement, or experts % EP size != 0): FlashInfer then computes the
  wrong experts (``support.ep_layout_problem``).

The modular_method design (0.11.1 - 0.13.0): ModelOpt is consistent everywhere (#26135);
compressed-tensors with DP dispatch (dp, dp_ep_*) still pre-quantizes with element 0 -> affected
iff not all equal.

The nvfp4_oracle design (0.14.0 - 0.34.0): ModelOpt is consistent everywhere; compressed-tensors
under DP+EP (dp_ep_*) quantizes on the sender with the max amax of the *sender's* local experts and
dequantizes with the owner's -> affected iff the EP slices' maxima differ (at ``ep_size`` =
DP x TP, ``support.rank_local_maxima``). Single, pp, tp, tp_ep and dp without EP are consistent.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

from vllm_fp4_moe_plugin import support
from vllm_fp4_moe_plugin.scale_check import InvalidScaleError, check_scale, uncalibrated
from vllm_fp4_moe_plugin.support import Design

from .tensor_index import CheckpointError, checkpoint_dir, open_safetensors, read_json, tensor_files

LAYOUTS = ("single", "pp", "tp", "tp_ep", "dp_ep_allgather", "dp_ep_all2allv", "dp")


def layouts_judged(design: Design) -> tuple[str, ...]:
    """The report's layout columns: :data:`LAYOUTS`, plus the NVLink one-sided dispatch on the
    design that has it (doctor looks a deployment's layout up here)."""
    extra = ("dp_ep_one_sided",) if design is Design.NVFP4_ORACLE else ()
    return LAYOUTS + extra
PLACEMENTS = ("linear", "round_robin")
FORMATS = ("modelopt", "compressed-tensors")
INPUT_SCALE = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}
# Per-expert weight global scales: the plugin refuses a bad one at load, so the audit reads them
# too (scalars, as cheap as the input scales; never the weights or block scales).
WEIGHT_SCALE = {"modelopt": "weight_scale_2", "compressed-tensors": "weight_global_scale"}
# Checkpoint projection names -> FusedMoE shard; Mixtral-style checkpoints use w1/w3/w2.
PROJECTION_STYLES = ({"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
                     {"w1": "w1", "w3": "w3", "w2": "w2"})
_EXPERT_TENSOR = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\."
                            r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.")
# config.json keys holding the routed-expert count (DeepSeek, Qwen3-MoE, Mixtral).
NUM_EXPERTS_KEYS = ("n_routed_experts", "num_experts", "num_local_experts")


class CheckpointAuditError(CheckpointError):
    """The checkpoint cannot be audited; the message names the file, tensor or layer and the
    fix."""


@contextlib.contextmanager
def _audit_errors() -> Iterator[None]:
    try:
        yield
    except CheckpointAuditError:
        raise
    except CheckpointError as exc:
        raise CheckpointAuditError(str(exc)) from None


# --- which format --------------------------------------------------------------------------

def _is_nvfp4_args(args) -> bool:
    return (isinstance(args, dict) and args.get("num_bits") == 4 and args.get("type") == "float"
            and args.get("strategy") == "tensor_group" and args.get("group_size") == 16)


def _compressed_tensors_format(qc: dict, where: str) -> str:
    """compressed-tensors: W4A4 NVFP4 needs both weights and input activations in NVFP4
    (vllm/.../compressed_tensors/compressed_tensors.py:270-289)."""
    groups = qc.get("config_groups") or {}
    w4 = [g for g, s in groups.items() if isinstance(s, dict) and _is_nvfp4_args(s.get("weights"))]
    if not w4:
        raise CheckpointAuditError(
            f"{where}: compressed-tensors checkpoint without an NVFP4 config group (weights "
            "num_bits=4, type=float, strategy=tensor_group, group_size=16); this audit only "
            "applies to NVFP4 checkpoints")
    if not any(_is_nvfp4_args(groups[g].get("input_activations")) for g in w4):
        raise CheckpointAuditError(
            f"{where}: NVFP4 weights but no NVFP4 input_activations (NVFP4A16, weight-only): the "
            "checkpoint has no activation scales, so the GEMM1 activation-scale bug cannot apply")
    return "compressed-tensors"


def detect_format(root: Path, config: dict) -> tuple[str, str, list[str]]:
    """``(format, where the quant config came from, warnings)`` in vLLM 0.11.0's order:
    config.json ``quantization_config`` wins over ``hf_quant_config.json``
    (transformers_utils/config.py:599-611; method detection config/model.py:857-876)."""
    warnings: list[str] = []
    qc = config.get("quantization_config")
    if qc is not None:
        where = f"{root / 'config.json'} quantization_config"
        if not isinstance(qc, dict):
            raise CheckpointAuditError(f"{where} must be a JSON object")
        method = str(qc.get("quant_method", "")).lower()
        if method == "compressed-tensors":
            return _compressed_tensors_format(qc, where), where, warnings
        if method == "modelopt":
            algo = str(qc.get("quant_algo", ""))
            if "FP4" not in algo.upper():
                raise CheckpointAuditError(f"{where}: ModelOpt quant_algo {algo!r} is not NVFP4")
            if "ignore" in qc and "exclude_modules" not in qc:
                warnings.append(
                    f"{where} uses ModelOpt >= 0.31's 'ignore' key, which vLLM 0.11.0 does not "
                    "read (it sees exclude_modules=[] and quantizes attention/lm_head too); "
                    "use hf_quant_config.json or add 'exclude_modules'")
            return "modelopt", where, warnings
        raise CheckpointAuditError(
            f"{where}: quant_method {qc.get('quant_method')!r} is not an NVFP4 format this audit "
            f"knows ({FORMATS[0]!r} or {FORMATS[1]!r})")
    hf = root / "hf_quant_config.json"
    if not hf.exists():
        raise CheckpointAuditError(
            f"{root}: not a quantized checkpoint (config.json has no quantization_config and "
            "there is no hf_quant_config.json)")
    hq = read_json(hf, what="ModelOpt hf_quant_config.json")
    producer = (hq.get("producer") or {}).get("name") if isinstance(hq.get("producer"), dict) \
        else None
    algo = (hq.get("quantization") or {}).get("quant_algo") \
        if isinstance(hq.get("quantization"), dict) else None
    if producer != "modelopt":
        raise CheckpointAuditError(
            f"{hf}: producer.name is {producer!r}, not 'modelopt'; vLLM 0.11.0 then treats the "
            "checkpoint as unquantized (config/model.py:857-876); add "
            "\"producer\": {\"name\": \"modelopt\", ...}")
    if algo != "NVFP4":
        raise CheckpointAuditError(f"{hf}: quantization.quant_algo is {algo!r}, not 'NVFP4'")
    return "modelopt", str(hf), warnings


# --- config keys transformers 4 reads under other names ---------------------------------------
# transformers 5 writes some config keys under new names and reads both; transformers 4 (the one
# vLLM 0.11.0 to 0.13.x run with) reads only the old name and silently takes its default
# (measured with transformers 4.57.1 on a Qwen3-MoE config that transformers 5.17 wrote:
# num_experts 128 instead of 8, rope_theta 10000.0 instead of 1e6). model types -> (new key,
# old key, transformers 4's default).
RENAMED_KEYS = {
    ("qwen3_moe", "qwen2_moe"): (("num_local_experts", "num_experts", 128),),
}
TOKENIZER_CLASSES_T5_ONLY = ("TokenizersBackend",)


def transformers4_misreads(config: dict, tokenizer_config: Optional[dict] = None) -> list[str]:
    """What a transformers-4 reader gets wrong in this checkpoint's JSON, each with the key to
    add (the files are never rewritten)."""
    out = []
    model_type = config.get("model_type")
    for types, renamed in RENAMED_KEYS.items():
        if model_type not in types:
            continue
        for new, old, default in renamed:
            if new in config and old not in config:
                out.append(f"config.json has {new}={config[new]!r} (transformers 5's name) but no "
                           f"{old}: transformers 4 (vLLM 0.11.0 - 0.13.x) reads {old} and "
                           f"falls back to {default}; add \"{old}\": {json.dumps(config[new])}")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        out.append("config.json has rope_parameters (transformers 5) but no top-level rope_theta: "
                   "transformers 4 falls back to the model class default (10000.0 for "
                   "Qwen3-MoE) and positions are silently wrong; add \"rope_theta\": "
                   f"{json.dumps(rope['rope_theta'])}")
    cls = (tokenizer_config or {}).get("tokenizer_class")
    if cls in TOKENIZER_CLASSES_T5_ONLY:
        out.append(f"tokenizer_config.json has tokenizer_class {cls!r}, which transformers 4 "
                   "cannot load (vLLM 0.11.0 - 0.13.x fail at startup); set "
                   "\"tokenizer_class\": \"PreTrainedTokenizerFast\"")
    return out


# Quantization-args fields newer compressed-tensors write that compressed-tensors 0.11.0 (vLLM
# 0.11.0's pin) refuses ("Extra inputs are not permitted"), so vLLM 0.11.0 cannot start with the
# checkpoint (measured on llmcompressor 0.14's output, which writes compressed-tensors 0.19's).
NEWER_QUANT_ARGS = ("scale_dtype", "zp_dtype")


def compressed_tensors_011_refuses(config: dict) -> list[str]:
    """What compressed-tensors 0.11.0 refuses in ``quantization_config``, with the fix."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return []
    found = sorted({key for group in (qc.get("config_groups") or {}).values()
                    if isinstance(group, dict)
                    for args in (group.get("weights"), group.get("input_activations"))
                    if isinstance(args, dict) for key in NEWER_QUANT_ARGS if key in args})
    if not found:
        return []
    return [f"config.json quantization_config has {', '.join(found)} in its quantization "
            "args (written by compressed-tensors >= 0.12): compressed-tensors 0.11.0 (vLLM "
            "0.11.0) refuses them and vLLM does not start; remove those keys from "
            "config_groups.*.weights and .input_activations (their values are the NVFP4 "
            "defaults)"]


# --- which tensors --------------------------------------------------------------------------

def _natural_key(s: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _moe_layers(names) -> dict[str, dict]:
    """``{layer prefix: {"experts": set, "style": projection names}}`` from tensor names."""
    layers: dict[str, dict] = defaultdict(lambda: {"experts": set(), "projs": set()})
    for name in names:
        m = _EXPERT_TENSOR.match(name)
        if m:
            layers[m["layer"]]["experts"].add(int(m["e"]))
            layers[m["layer"]]["projs"].add(m["proj"])
    return dict(layers)


def _num_experts(config: dict, layer: str, seen: set[int]) -> int:
    for key in NUM_EXPERTS_KEYS:
        n = config.get(key)
        if isinstance(n, int) and n > 0:
            if max(seen) >= n:
                raise CheckpointAuditError(
                    f"{layer}: tensors of expert {max(seen)} but config.json {key}={n}; fix "
                    f"{key} or remove the extra experts")
            return n
    return max(seen) + 1


def _style(layer: str, projs: set[str]) -> dict[str, str]:
    for style in PROJECTION_STYLES:
        if projs & set(style.values()):
            return style
    raise CheckpointAuditError(f"{layer}: unrecognised expert projection names {sorted(projs)}")


def _read_scalars(names: dict[str, Path]) -> dict[str, float]:
    """``get_tensor`` on exactly these names, one lazy ``safe_open`` per shard; each tensor is
    judged by the plugin's own rule (:func:`scale_check.check_scale`): float dtype, one element,
    finite and > 0."""
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
    """A tensor numpy could not read: if its header dtype is not one a global scale may have
    (float8, say), say so with the allowed ones rather than numpy's words."""
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


# --- the verdict ----------------------------------------------------------------------------

def ep_slices(num_experts: int, ep_size: int, placement: str = "linear") -> list[list[int]]:
    """Global expert ids per EP rank as ``determine_expert_map`` assigns them (the same in
    0.11.0, layer.py:818-841, and 0.34.0): :func:`vllm_fp4_moe_plugin.support.ep_slices`."""
    if placement not in PLACEMENTS:
        raise ValueError(f"expert placement {placement!r} must be one of {PLACEMENTS}")
    if ep_size < 1:
        raise ValueError(f"ep_size={ep_size} must be >= 1")
    return support.ep_slices(num_experts, ep_size, placement)




def _amax_like(fmt: str, stored: list[float]) -> list[float]:
    """Proportional to the activation amax: ModelOpt's input_scale, 1 / compressed-tensors'
    input_global_scale (a stored 0 becomes inf, a negative stays negative)."""
    if fmt != "compressed-tensors":
        return list(stored)
    return [1.0 / v if v else math.inf for v in stored]


def _with_fallback(fmt: str, layer: str, what: str, stored: list[float],
                   bad) -> list[float]:
    """``stored`` with the uncalibrated experts given the calibrated experts' max amax: what the
    plugin loads (``scales.repair_uncalibrated``)."""
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


def _layer_report(fmt: str, layer: str, gate: list[float], up: list[float], down: list[float],
                  ep_size: int, placement: str,
                  design: Design = Design.INIT_PREPARE_FINALIZE,
                  missing: Optional[dict] = None) -> dict:
    """``missing``: per GEMM ("w13", "w2"), the experts whose input-scale tensor the checkpoint
    lacks (their values arrive as NaN): uncalibrated, and stock computes with whatever its
    uninitialised parameter held, so it is wrong with them in every design."""
    missing = missing or {"w13": [], "w2": []}
    ct = fmt == "compressed-tensors"
    ep_slices(len(gate), ep_size, placement)  # placement and EP size, checked with audit's words
    # Uncalibrated experts (scale_check.uncalibrated, judged on gate and up each) are reported
    # on their own; every figure below is of the layer the plugin loads, where they carry the
    # calibrated experts' max amax (the stored gate and up values of such an expert differ:
    # both get the fallback).
    bad13 = uncalibrated(list(zip(_amax_like(fmt, gate), _amax_like(fmt, up))))
    bad2 = uncalibrated(_amax_like(fmt, list(down)))
    gate_used = _with_fallback(fmt, layer, "GEMM1 (gate/up)", list(gate), bad13)
    up_used = _with_fallback(fmt, layer, "GEMM1 (gate/up)", list(up), bad13)
    down_used = _with_fallback(fmt, layer, "GEMM2 (down_proj)", list(down), bad2)
    kinds = sorted(set(bad13.values()) | set(bad2.values()))
    # vLLM keeps one GEMM1 scale per expert: .max() over gate/up of the *stored* quantity
    # (modelopt.py:1307-1308, compressed_tensors_moe.py:300-301).
    w13_raw = [max(g, u) for g, u in zip(gate, up)]
    w13 = [max(g, u) for g, u in zip(gate_used, up_used)]

    def amax_like(v):  # ModelOpt sense: what the kernel dequantizes GEMM1 input with
        return [1.0 / x for x in v] if ct else list(v)

    def factor(v, e):  # in_scale[e] / in_scale[0], from the stored values without a reciprocal
        return v[0] / v[e] if ct else v[e] / v[0]

    factors = [factor(w13, e) for e in range(len(w13))]
    # 0.14.0+: the activation amax per expert, max over gate/up (v0.34.0 CT w4a4_nvfp4.py:242,
    # 1 / input_global_scale; ModelOpt's input_scale is already an amax-like scale).
    amax = amax_like(w13)
    calibrated_gate_up = [v for e, (g, u) in enumerate(zip(gate, up)) if e not in bad13
                          for v in (g, u)]
    uniform = len(set(calibrated_gate_up)) <= 1
    by_scales = support.stock_wrong_with_scales(design, fmt, w13, amax, ep_size, placement,
                                                layouts_judged(design))
    by_uncalibrated = (support.stock_wrong_with_uncalibrated(design, fmt, kinds)
                       or bool(missing["w13"] or missing["w2"]))
    report = {
        "layer": layer,
        "num_experts": len(w13),
        "stored_name": INPUT_SCALE[fmt],
        "w13_stored": w13_raw,
        "w2_stored": list(down),
        "w13_input_scale": amax_like(w13),
        "w2_input_scale": amax_like(down_used),
        # max/min is invariant under the reciprocal, so take it from the stored values (exact).
        "w13_spread": max(w13) / min(w13),
        "w2_spread": max(down_used) / min(down_used),
        "reference_expert": 0,
        "error_factor_max": max(factors),
        "error_factor_min": min(factors),
        "gate_up_mismatch": [e for e, (g, u) in enumerate(zip(gate, up))
                             if g != u and e not in bad13],
        # The calibration's signature: all-experts calibration shows every expert the same
        # tokens, so every gate/up input scale is identical; routed calibration spreads them.
        "calibration": "all-experts" if uniform else "routed",
        "uncalibrated_w13": sorted(bad13),
        "uncalibrated_w2": sorted(bad2),
        "uncalibrated_kinds": kinds,
        "missing_w13": missing["w13"],
        "missing_w2": missing["w2"],
        "stock_wrong_uncalibrated": by_uncalibrated,
        # An uncalibrated expert that stock uses is wrong in every layout (none re-scales it).
        "affected": {lay: hit or by_uncalibrated for lay, hit in by_scales.items()},
        "affected_by_scales": by_scales,  # the design's hole alone (the calibrated scales)
        "layout_problem": (support.ep_layout_problem(len(w13), ep_size, placement)
                           if design is Design.INIT_PREPARE_FINALIZE else None),
    }
    if design is Design.NVFP4_ORACLE:
        report["ep_rank_max_amax"] = support.rank_local_maxima(amax, ep_size, placement)
        report["dp_ep_off_by"] = (support.stock_dp_ep_off_by(amax, ep_size, placement)
                                  if ct else 1.0)
    return report


def _summary(layers: list[dict], design: Design = Design.INIT_PREPARE_FINALIZE,
             ep_size: int = 2) -> str:
    """The verdict line: uncalibrated experts first when stock uses them, then the design's
    hole judged on the scales as calibrated."""
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
    problem = next((entry["layout_problem"] for entry in layers if entry["layout_problem"]),
                   None)
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
            "vs expert 0); stock vLLM 0.11.0's FlashInfer CUTLASS NVFP4 MoE computes them "
            "wrongly")


def audit_checkpoint(path, *, ep_size: int = 2, expert_placement: str = "linear",
                     design: Design = Design.INIT_PREPARE_FINALIZE) -> dict:
    """Audit the per-expert activation scales of every NVFP4 MoE layer under ``path``.

    ``ep_size``/``expert_placement`` describe the EP layouts judged (0.11.0: ``tp_ep``; 0.14.0:
    the ``dp_ep_*`` layouts, EP size = DP x TP); default 2 ranks, vLLM's default linear
    placement. ``design``: whose semantics (``support.DESIGNS``). Raises
    :class:`CheckpointAuditError`.
    """
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
        files = tensor_files(root)
        layers = _moe_layers(files)
        if not layers:
            raise CheckpointAuditError(
                f"{root}: no routed-expert tensors (names like "
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
                            f"{layer}: expert {e} has no weight scale tensor {weight} in "
                            f"{root}; its NVFP4 weights cannot be dequantized -- re-export the "
                            "checkpoint")
                    if weight in files:
                        wanted[weight] = files[weight]
                    if name not in files:  # an uncalibrated expert (vllm#45212), not corruption
                        absent.add(name)
                        continue
                    wanted[name] = files[name]
            plan.append((layer, names))
        values = _read_scalars(wanted)
        values.update({name: math.nan for name in absent})  # as the plugin sees it: no value
    reports = [_layer_report(fmt, layer, *[[values[n] for n in names[shard]]
                                           for shard in ("w1", "w3", "w2")],
                             ep_size, expert_placement, design,
                             missing={g: sorted({e for shard in shards
                                                 for e, n in enumerate(names[shard])
                                                 if n in absent})
                                      for g, shards in (("w13", ("w1", "w3")), ("w2", ("w2",)))})
               for layer, names in plan]
    for entry in reports:
        if entry["gate_up_mismatch"]:
            warnings.append(
                f"{entry['layer']}: gate and up input scales differ for expert(s) "
                f"{entry['gate_up_mismatch'][:8]}; vLLM keeps one per expert (ModelOpt: the last "
                "loaded, compressed-tensors: the max global scale)")
    by_layout = {lay: sum(entry["affected"][lay] for entry in reports)
                 for lay in layouts_judged(design)}
    return {
        "path": str(root),
        "format": fmt,
        "quant_config_source": source,
        "design": design,
        "vllm_releases": support.design(design).releases,
        "ep_size": ep_size,
        "expert_placement": expert_placement,
        "num_scale_tensors_read": len(values),
        "layers": reports,
        "affected_layers": sum(any(entry["affected"].values()) for entry in reports),
        "affected_layers_by_layout": by_layout,
        "warnings": warnings,
        "transformers4_misreads": config_warnings,
        "compressed_tensors_011_refuses": ct_refuses,
        "calibration": calibration_line(reports),
        "summary": _summary(reports, design, ep_size),
    }


def format_audit(report: dict, *, max_layers: Optional[int] = None) -> str:
    """A human-readable table of :func:`audit_checkpoint`'s report."""
    design = support.design(report.get("design", Design.INIT_PREPARE_FINALIZE))
    ep_layouts = "tp_ep" if design is Design.INIT_PREPARE_FINALIZE else "EP layouts"
    head = [f"NVFP4 MoE activation-scale audit (stock vLLM {support.design(design).releases} "
            f"semantics, MoE design {design.value})",
            f"  checkpoint : {report['path']}",
            f"  format     : {report['format']} (from {report['quant_config_source']})",
            f"  {ep_layouts:<11}: ep_size={report['ep_size']}, {report['expert_placement']} "
            "placement",
            ""]
    columns = layouts_judged(design)
    cols = "  ".join(f"{lay:>{max(5, len(lay))}}" for lay in columns)
    err_head = "dp_ep off by" if design is Design.NVFP4_ORACLE else "error vs expert 0"
    width = max([len(entry["layer"]) for entry in report["layers"]] + [5])
    lines = [f"{'layer':<{width}}  {'E':>4}  {'w13 spread':>10}  {'w2 spread':>9}  "
             f"{err_head:>17}  {cols}"]
    shown = report["layers"] if max_layers is None else report["layers"][:max_layers]
    for entry in shown:
        err = (f"{entry['dp_ep_off_by']:.3g}x" if design is Design.NVFP4_ORACLE else
               f"{entry['error_factor_min']:.3g}..{entry['error_factor_max']:.3g}x")
        flags = "  ".join(f"{('yes' if entry['affected'][lay] else 'no'):>{max(5, len(lay))}}"
                          for lay in columns)
        lines.append(f"{entry['layer']:<{width}}  {entry['num_experts']:>4}  "
                     f"{entry['w13_spread']:>9.4g}x  {entry['w2_spread']:>8.4g}x  {err:>17}  "
                     f"{flags}")
        stock = "uses them: wrong" if entry["stock_wrong_uncalibrated"] else "ignores them"
        for gemm in ("w13", "w2"):
            if entry[f"uncalibrated_{gemm}"]:
                gone = entry.get(f"missing_{gemm}")
                lines.append(f"  uncalibrated {gemm} input scale: expert(s) "
                             f"{entry[f'uncalibrated_{gemm}']}"
                             + (f", missing from the checkpoint: {gone}" if gone else "")
                             + f" (stock {stock}; the plugin loads the calibrated experts' max "
                             "amax)")
    if len(shown) < len(report["layers"]):
        lines.append(f"... {len(report['layers']) - len(shown)} more layer(s)")
    tail = ["", f"affected layers: {report['affected_layers']} of {len(report['layers'])}",
            report["calibration"], report["summary"]]
    tail += [f"warning: {w}" for w in report["warnings"]]
    return "\n".join(head + lines + tail)
