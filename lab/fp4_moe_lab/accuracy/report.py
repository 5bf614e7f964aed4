# SPDX-License-Identifier: Apache-2.0
"""The accuracy table's report: docs/ACCURACY.md's table (with the audit's verdict of where
stock is wrong, run afresh) and the chart docs/data/accuracy.png, both from the table's JSON."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import tempfile
from pathlib import Path

from fp4_moe_lab.accuracy.cells import (
    CHECKPOINTS,
    COLUMNS,
    LAYOUTS,
    MD_OUT,
    MODELS,
    PNG_OUT,
    PRIORITY,
    REPO,
    WORLD_LAYOUTS,
    cell_key,
    dir_of,
    failure_reason,
    present_checkpoints,
)

# run_table layout -> the audit's layout name (lab/fp4_moe_lab/simulation/layouts.py); DP+EP
# on the CPU engines uses vLLM's naive all-gather / reduce-scatter DP/EP prepare/finalize
AUDIT_LAYOUT = {"single": "single", "tp2ep": "tp_ep", "dp2ep": "dp_ep_allgather", "dp2": "dp"}


@functools.cache
def audit_holes(world: str, ckpt_dir: str) -> dict | None:
    """``vllm-fp4-moe audit --json --vllm WORLD`` of the checkpoint (the main .venv's, the
    plugin's one model of where stock is wrong): affected MoE layers per audit layout, run
    afresh for every report. None when the main world is missing."""
    cli = REPO / ".venv" / "bin" / "vllm-fp4-moe"
    if not cli.exists():
        return None
    p = subprocess.run([str(cli), "audit", "--json", "--vllm", world, str(MODELS / ckpt_dir)],
                       capture_output=True, text=True, timeout=600)
    if p.returncode not in (0, 1) or not p.stdout.strip():
        raise RuntimeError(f"audit failed ({p.returncode}): {p.stderr[-2000:]}")
    out = json.loads(p.stdout)
    return {"design": out.get("design"), "layers": len(out.get("layers", [])),
            "affected_by_layout": out.get("affected_layers_by_layout", {})}


def hole_text(data: dict, world: str, layout: str, ckpt_dir: str) -> str:
    """The table's verdict; also recorded in the JSON (``audit``) next to the cells. A world
    with upstream/'s patches has no hole; the audit models its stock release."""
    if world.endswith("-patched"):
        base = world.removesuffix("-patched")
        return f"no, patched ({base}: {hole_text(data, base, layout, ckpt_dir)})"
    a = audit_holes(world, ckpt_dir)
    if a is None:
        return "?"
    data.setdefault("audit", {})[f"{world}|{CHECKPOINTS[ckpt_dir][0]}"] = a
    n = a["affected_by_layout"].get(AUDIT_LAYOUT[layout], 0)
    return f"yes ({n} of {a['layers']} layers)" if n else "no"


def edited(ckpt_dir: str) -> str | None:
    """The script that made a labelled edit (it writes its log next to the weights), or None for
    a quantizer's output."""
    for script, log in (("accuracy/skew.py", "skew-log.json"),
                        ("accuracy/dead_scale.py", "dead-log.json"),
                        ("accuracy/gate_up_split.py", "split-log.json")):
        if (MODELS / ckpt_dir / log).is_file():
            return script
    return None


def fmt_cell(c: dict | None) -> str:
    if not c:
        return "—"
    return f"{c['accuracy']:.3f} [{c['wilson95'][0]:.3f}, {c['wilson95'][1]:.3f}] (n={c['n']})"


def table_rows(data: dict) -> list[dict]:
    cells = data.get("cells", {})
    fails = data.get("failures", {})
    rows = []
    for world, layout in sorted(PRIORITY,
                                key=lambda wl: (wl[0], WORLD_LAYOUTS[wl[0]].index(wl[1]))):
        for d, name, fmt in present_checkpoints():
            got = {col: cells.get(cell_key(world, layout, name, col)) for col in COLUMNS}
            failed = {col: fails[cell_key(world, layout, name, col)].get("reason") or
                      failure_reason(fails[cell_key(world, layout, name, col)]["error"])
                      for col in COLUMNS if not got[col]
                      and cell_key(world, layout, name, col) in fails}
            if not any(got[c] or c in failed for c in ("ideal", "stock", "plugin")):
                continue
            tp, dp, ep = LAYOUTS[layout]
            rows.append({"world": world, "layout": layout, "checkpoint": name, "format": fmt,
                         "edited": edited(d),
                         "tp": tp, "dp": dp, "ep": ep, "cells": got, "failed": failed,
                         "row_wall_s": round(sum(c["wall_s"] for c in got.values() if c), 1)})
    return rows


def layout_flags(tp: int, dp: int, ep: bool) -> str:
    flags = []
    if tp > 1:
        flags.append(f"--tensor-parallel-size {tp}")
    if dp > 1:
        flags.append(f"--data-parallel-size {dp}")
    if ep:
        flags.append("--enable-expert-parallel")
    return " ".join(flags) or "(none)"


def write_markdown(data: dict) -> None:
    rows = table_rows(data)
    lines = ["| vLLM | checkpoint | layout (flags) | EP=2 GEMM1 slice-max ratio per layer | "
             "stock wrong here? (audit) | " + " | ".join(COLUMNS) + " | row time |",
             "|" + "---|" * (6 + len(COLUMNS))]
    for r in rows:
        sc = data.get("checkpoints", {}).get(r["checkpoint"], {}).get("scales", {})
        ratio = ", ".join(f"{v['ep2_ratio_rank1_over_rank0']:.3g}" for _, v in sorted(sc.items())
                          if v.get("ep2_ratio_rank1_over_rank0") is not None) or "?"
        label = f" EDITED by {r['edited']}" if r["edited"] else ""
        lines.append(f"| {r['world']} | {r['checkpoint']} ({r['format']}{label}) | {r['layout']} "
                     f"(`{layout_flags(r['tp'], r['dp'], r['ep'])}`) | {ratio} | "
                     f"{hole_text(data, r['world'], r['layout'], dir_of(r['checkpoint']))} | "
                     + " | ".join(fmt_cell(r["cells"][c]) if r["cells"][c] or c not in r["failed"]
                                  else f"server failed to start: {r['failed'][c][:110]}"
                                  for c in COLUMNS)
                     + f" | {r['row_wall_s']/60:.1f} min |")
    table = "\n".join(lines)
    text = (MD_OUT.read_text() if MD_OUT.exists()
            else "# Accuracy\n\n<!-- table -->\n<!-- /table -->\n")
    begin, end = "<!-- table -->", "<!-- /table -->"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        _, tail = rest.split(end, 1)
        text = f"{head}{begin}\n{table}\n{end}{tail}"
    MD_OUT.write_text(text)


def plot_python() -> str | None:
    cands = [os.environ.get("FP4MOE_PLOT_PYTHON")] + [
        str(REPO / v / "bin" / "python") for v in (".venv-plot", ".venv", ".venv-engine-0.32.0",
                                                   ".venv-engine")]
    for c in cands:
        if c and Path(c).exists() and subprocess.run(
                [c, "-c", "import matplotlib"], capture_output=True, timeout=120).returncode == 0:
            return c
    return None


PLOT_PROGRAM = REPO / "accuracy" / "plot_table.py"  # run in a Python with matplotlib


def write_chart(data: dict) -> str:
    py = plot_python()
    if py is None:
        return "no Python with matplotlib (pip install matplotlib into .venv-plot)"
    rows = table_rows(data)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(rows, f)
    p = subprocess.run([py, str(PLOT_PROGRAM), f.name, str(PNG_OUT)], capture_output=True,
                       text=True, timeout=300)
    return "ok" if p.returncode == 0 else p.stderr[-2000:]
