# SPDX-License-Identifier: Apache-2.0
"""The companion table to the matrix: what stock and the plugin compute when one expert's
activation scale is what a quantizer writes for an expert that saw no calibration token.

Real vLLM layers of the installed release, in real gloo ranks, as the matrix runs them
(:mod:`.layouts`); one expert planted per row (:mod:`.planted_scales`): GEMM1 (gate/up) or GEMM2
(down_proj) input scale in one value class the field reports (0.0, llmcompressor's 1.57e-29, NaN,
+inf, a denormal, a negative value, or the tensor missing from the checkpoint), or a
legitimately rare expert with 20x the layer's largest amax (which must stay untouched). The
fixture's other experts share one amax (``input_scale_spread=1``, as all-experts calibration writes
GEMM1's), so whatever stock gets wrong here is the planted expert's doing. Each row is judged by the
matrix's one rule (:func:`.judge.judge`) against the ideal NVFP4 reference of the layer a correct
loader computes with: the uncalibrated expert at the calibrated experts' max amax.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Iterable, Optional

import torch

from fp4_moe_lab.simulation.judge import installed_release, judge
from fp4_moe_lab.simulation.layouts import (
    LAYOUTS,
    RankContext,
    Scenario,
    spawn,
    stock_and_plugin_outputs,
)
from fp4_moe_lab.simulation.matrix import BACKEND, reference_scheme, references
from fp4_moe_lab.simulation.planted_scales import CASES, GEMMS, LARGE_FACTOR  # noqa: F401

DEFAULT_LAYOUTS = ("single", "dp_ep_allgather")
DEFAULT_PLANTS = tuple((gemm, case) for case in CASES for gemm in GEMMS)
FORMATS = ("modelopt", "compressed-tensors")


def base_scenario() -> Scenario:
    return Scenario(input_scale_spread=1.0)


def planted_outputs(ctx: RankContext, scenarios: tuple, formats: tuple) -> list:
    """Job (inside each rank): stock and plugin outputs per planted scenario and format, with
    the plugin's WARNING lines about uncalibrated experts in ``info["<fmt>/warnings"]`` (the
    once-per-process warning state is reset before each layer, so each may warn)."""
    from vllm_fp4_moe_plugin.scales import layer_scales

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.levelno >= logging.WARNING:
                lines.append(record.getMessage())

    handler = Collect()
    logger = logging.getLogger("vllm.fp4_moe_plugin.layer_scales")
    logger.addHandler(handler)
    out = []
    index = 0
    try:
        for scenario in scenarios:
            merged = None
            for fmt in formats:
                layer_scales._reset_for_tests()
                del lines[:]
                result = stock_and_plugin_outputs(ctx, scenario, (fmt,), ("stock", "plugin"),
                                                  first_index=index)
                index += 2
                result.info[f"{fmt}/warnings"] = list(lines)
                merged = result.merged(merged)
            out.append(merged)
    finally:
        logger.removeHandler(handler)
    return out


def output_kind(ranks, key: str) -> str:
    """What a layer's output looks like on every rank: nan, zero, or finite."""
    outs = [r.outputs.get(key) for r in ranks]
    if any(o is None for o in outs):
        return "fails"
    if any(not bool(torch.isfinite(o).all()) for o in outs):
        return "nan"
    return "zero" if all(not bool(o.any()) for o in outs) else "finite"


def run_uncalibrated(layouts: Optional[Iterable[str]] = None,
                     plants: Iterable[tuple[str, str]] = DEFAULT_PLANTS,
                     formats=FORMATS, progress=None) -> list[dict]:
    """One row per layout x planted (gemm, case) x format, as dicts (the matrix row's keys plus
    ``gemm``, ``case``, ``stock_output``, ``plugin_output``, ``plugin_warnings``)."""
    base = base_scenario()
    scenarios = [replace(base, planted=plant) for plant in plants]
    # (gemm, case) or (gemm, case, count): ``count`` experts planted (planted_scales)
    labels = [dict(gemm=p[0], case=p[1], count=(p[2:] or (1,))[0]) for p in plants]
    return _rows(scenarios, labels, layouts or DEFAULT_LAYOUTS, formats, progress)


def run_checkpoint(path: str, layers: Iterable[int], layouts: Optional[Iterable[str]] = None,
                   progress=None) -> list[dict]:
    """The same rows for a real checkpoint's MoE layers, as its quantizer wrote them (format
    from the file; keys ``layer`` and ``uncalibrated``, the experts the plugin's rule finds)."""
    from fp4_moe_lab.simulation import checkpoint_layer

    layers = list(layers)
    fmt = checkpoint_layer.read_layer(str(path), layers[0])[0]
    scenarios = [Scenario(checkpoint=str(path), layer=layer) for layer in layers]
    labels = [dict(layer=layer, uncalibrated=checkpoint_layer.uncalibrated(str(path), layer))
              for layer in layers]
    return _rows(scenarios, labels, layouts or DEFAULT_LAYOUTS, (fmt,), progress)


def _rows(scenarios, labels, layouts, formats, progress) -> list[dict]:
    version, design = installed_release()
    rows = []
    for name in layouts:
        layout = LAYOUTS[name]
        if progress:
            progress(f"uncalibrated: {name} ({len(scenarios)} layers or planted experts x "
                     f"{len(formats)} formats)")
        per_rank = spawn(layout, f"{__name__}:planted_outputs", tuple(scenarios), tuple(formats))
        for i, (scenario, label) in enumerate(zip(scenarios, labels)):
            ranks = [outputs[i] for outputs in per_rank]
            for fmt in formats:
                scheme = reference_scheme(design, fmt, layout)

                def refs(r, scenario=scenario, scheme=scheme, layout=layout):
                    return references(scenario, r.dp_rank, scheme, ep_size=layout.ep_size)

                row = judge(fmt, name, BACKEND, ranks, refs, scheme=scheme,
                            release=(version, design), equally_accurate_ok=True).as_dict()
                row.update(label, stock_output=output_kind(ranks, f"{fmt}/stock"),
                           plugin_output=output_kind(ranks, f"{fmt}/plugin"),
                           plugin_warnings=[w for r in ranks for w in r.info[f"{fmt}/warnings"]])
                rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    head = ("format", "layout", "planted", "stock err", "stock output", "plugin err",
            "noise floor", "plugin == stock", "warned", "ok")

    def err(r, mode):
        v = r[f"{mode}_rel_err"]
        return "fails" if r[f"{mode}_error"] else ("nan" if not math.isfinite(v) else f"{v:.3g}")

    body = [(r["format"], r["layout"], f"{r['gemm']} {r['case']}", err(r, "stock"),
             r["stock_output"], err(r, "plugin"), f"{r['noise_floor']:.3g}",
             "bit-identical" if r["bit_identical"] else "no",
             "yes" if r["plugin_warnings"] else "no", "yes" if r["ok"] else "NO")
            for r in rows]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    line = " | ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join([line.format(*head), "-+-".join("-" * w for w in widths)]
                     + [line.format(*b) for b in body])
