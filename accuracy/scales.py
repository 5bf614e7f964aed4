# SPDX-License-Identifier: Apache-2.0
"""Tabulate the MoE activation scales of every NVFP4 checkpoint under accuracy/models/.

Why: the plugin's bugs are all about how vLLM combines the experts' activation scales, so the
numbers that matter for a checkpoint are, per MoE layer, how far its experts' GEMM1 (gate/up,
"w13") and GEMM2 (down, "w2") input scales spread, and, for expert parallelism over 2 ranks
(the first half of the experts on rank 0, the second on rank 1: 0-3 / 4-7 of 8), how far apart the
two ranks' largest amax are: vLLM 0.14.0+ collapses GEMM1's activation scale to the max amax
over a rank's loaded experts, so under DP+EP a token from rank r on an expert of rank s is off by
amax_s / amax_r (README, docs/ROOT-CAUSE.md §12). Experts that calibration never reached are
flagged.

Reads safetensors only (no torch model). Conventions:
  compressed-tensors: input_global_scale = 448 * 6 / amax  -> amax = 2688 / scale
  ModelOpt:           input_scale = amax / (448 * 6)       -> amax = 2688 * input_scale
Writes accuracy/models/SCALES.md and SCALES.json.
Usage: python accuracy/scales.py [--models-dir accuracy/models]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re

from vllm_fp4_moe_plugin.scales.scale_rule import UNCALIBRATED_MARGIN, uncalibrated_experts

FP8_X_FP4 = 448.0 * 6.0


def ep2_slices(experts: list) -> tuple:
    """vLLM's linear expert placement over 2 EP ranks: first half, second half."""
    half = len(experts) // 2
    return tuple(experts[:half]), tuple(experts[half:])

KEY = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\."
                 r"(input_global_scale|input_scale)$")


def read_scales(path: str):
    """{(layer, expert, proj): (kind, raw float)} from one model.safetensors."""
    from safetensors import safe_open
    out = {}
    with safe_open(path, "np") as f:
        for k in f.keys():
            m = KEY.match(k)
            if m:
                v = f.get_tensor(k).reshape(-1)
                out[(int(m[1]), int(m[2]), m[3])] = (m[4], float(v[0]))
    return out


def amax_of(kind: str, raw: float) -> float:
    if kind == "input_global_scale":
        return FP8_X_FP4 / raw if raw != 0 else math.inf
    return FP8_X_FP4 * raw


def summarize(model_dir: str) -> dict | None:
    st = os.path.join(model_dir, "model.safetensors")
    if not os.path.exists(st):
        return None
    sc = read_scales(st)
    if not sc:
        return None
    fmt = "compressed-tensors" if next(iter(sc.values()))[0] == "input_global_scale" \
        else "modelopt"
    layers = sorted({k[0] for k in sc})
    experts = sorted({k[1] for k in sc})
    res = {"format": fmt, "layers": {}}
    for li in layers:
        lay = {}
        for name, projs in (("w13", ("gate", "up")), ("w2", ("down",))):
            raw = {e: {p: sc[(li, e, p)][1] for p in projs} for e in experts}
            kind = sc[(li, experts[0], projs[0])][0]
            # the plugin's own rule (one place: vllm_fp4_moe_plugin.scales.scale_rule)
            bad = uncalibrated_experts([tuple(amax_of(kind, raw[e][p]) for p in projs)
                                        for e in experts])
            # the amax an engine would use for the expert's GEMM: the larger of gate's and up's
            amax = {e: max(amax_of(kind, raw[e][p]) for p in projs) for e in experts}
            gate_ne_up = [e for e in experts if len(projs) == 2 and raw[e]["gate"] != raw[e]["up"]]
            good = [e for e in experts if e not in bad]
            ga = [amax[e] for e in good]
            scal = [raw[e][projs[0]] for e in good]
            slices = [[amax[e] for e in s if e in amax] for s in ep2_slices(experts)]
            slices_good = [[amax[e] for e in s if e in good] for s in ep2_slices(experts)]
            ent = {
                "scale_min": min(scal) if scal else None,
                "scale_max": max(scal) if scal else None,
                "amax_min": min(ga) if ga else None,
                "amax_max": max(ga) if ga else None,
                "spread": (max(ga) / min(ga)) if ga else None,
                "ep2_slice_max_amax": [max(s) if s else None for s in slices_good],
                "uncalibrated_experts": bad,
                "uncalibrated_raw": {str(e): raw[e] for e in bad},
                "gate_ne_up_experts": gate_ne_up,
                "per_expert_amax": {str(e): amax[e] for e in experts},
            }
            m0, m1 = ent["ep2_slice_max_amax"]
            if m0 and m1:
                ent["ep2_ratio_rank1_over_rank0"] = m1 / m0
                ent["ep2_error_factor"] = max(m0, m1) / min(m0, m1)
            if bad:   # what an engine that trusts the file computes, where that is defined
                vals = [raw[e][p] for e in bad for p in projs]
                if all(math.isfinite(v) and v > 0 for v in vals):
                    r0, r1 = (max(s) for s in slices)
                    ent["ep2_error_factor_as_written"] = max(r0, r1) / min(r0, r1)
                else:
                    ent["ep2_error_factor_as_written"] = "undefined (a scale <= 0 or not finite)"
            lay[name] = ent
        res["layers"][str(li)] = lay
    return res


def fmt_num(x, digits=4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and (x == 0 or abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits - 1}e}"
    return f"{x:.{digits}g}"


def render(all_res: dict) -> str:
    lines = [
        "# Activation scales of the NVFP4 checkpoints",
        "",
        "Written by `accuracy/scales.py` from the safetensors files (do not edit by hand).",
        "amax is implied by the stored scale: compressed-tensors `input_global_scale` = 2688 / "
        "amax, ModelOpt `input_scale` = amax / 2688. w13 = gate/up (GEMM1 input; per expert the "
        "larger amax of gate and up), w2 = down (GEMM2 input). spread = max/min amax over the "
        "calibrated experts. EP=2: the first half of the experts on rank 0, the second on rank 1 "
        "(0-3 / 4-7 of 8, 0-7 / 8-15 of 16); factor = larger / "
        "smaller of the two ranks' max amax (vLLM >= 0.14.0's DP+EP GEMM1 error for "
        "compressed-tensors). Experts whose scale is not a calibration (<= 0, not finite, "
        f"or more than {UNCALIBRATED_MARGIN:g}x from the layer's median amax: the plugin's rule, "
        "vllm_fp4_moe_plugin.scales.scale_rule) are listed as uncalibrated, with the raw values "
        "written, and left out of min/max/spread.",
        "",
        "| checkpoint | format | layer | proj | scale min | scale max | amax min | amax max "
        "| spread | EP=2 max amax r0 / r1 | EP=2 factor | uncalibrated (raw value) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, res in all_res.items():
        for li, lay in res["layers"].items():
            for proj, e in lay.items():
                m0, m1 = e["ep2_slice_max_amax"]
                unc = "; ".join(f"e{k}: {', '.join(fmt_num(v, 3) for v in raw.values())}"
                                for k, raw in e["uncalibrated_raw"].items()) or "none"
                if "ep2_error_factor_as_written" in e:
                    w = e["ep2_error_factor_as_written"]
                    unc += f" (EP=2 factor as written: {w if isinstance(w, str) else fmt_num(w)})"
                lines.append(
                    f"| {name} | {res['format']} | {li} | {proj} | {fmt_num(e['scale_min'])} | "
                    f"{fmt_num(e['scale_max'])} | {fmt_num(e['amax_min'])} | "
                    f"{fmt_num(e['amax_max'])} | {fmt_num(e['spread'])} | "
                    f"{fmt_num(m0)} / {fmt_num(m1)} | {fmt_num(e.get('ep2_error_factor'))} | "
                    f"{unc} |")
    lines.append("")
    return "\n".join(lines)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", default=os.path.join(here, "models"))
    args = ap.parse_args()
    all_res = {}
    for name in sorted(os.listdir(args.models_dir)):
        d = os.path.join(args.models_dir, name)
        if os.path.isdir(d):
            r = summarize(d)
            if r:
                all_res[name] = r
    with open(os.path.join(args.models_dir, "SCALES.json"), "w") as f:
        json.dump(all_res, f, indent=1)
        f.write("\n")
    with open(os.path.join(args.models_dir, "SCALES.md"), "w") as f:
        f.write(render(all_res))
    print(render(all_res))


if __name__ == "__main__":
    main()
