# SPDX-License-Identifier: Apache-2.0
"""``python -m benchmarks.run [--smoke] [--json PATH] [--worlds all|here]``: the benchmarks,
one table per release world (vLLM 0.11.0; the NVFP4-oracle design, 0.34.0).

Every row is a ratio measured side by side in one run of one world (plugin vs a named
baseline) with its target. A missed target prints MISSED but does not fail the exit
code; only a crash does. ``--smoke`` uses tiny sizes and a subset of layouts so the test suites
can run it. The world is the installed vLLM (:mod:`benchmarks.worlds`); ``--worlds all`` (the
default) also runs every other world whose virtualenv exists, with that virtualenv's python,
and the JSON holds each world's rows under ``worlds``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import worlds
from benchmarks.rows import Row, format_table

HERE = Path(__file__).resolve().parent
GPU_JSON = HERE / "emulator_h200.json"
ITEMS = (1, 2, 3, 4, 5, 6, 7, 8)  # 1-7: vLLM 0.11.0; 8: engine (oracle world)
SMOKE_LAYOUTS = ("single", "tp", "dp_ep_allgather")


def _layout_sizes(smoke: bool):
    from benchmarks.layout_runs import Sizes
    from fp4_moe_lab.simulation.layouts import LAYOUT_NAMES, Scenario

    if smoke:
        return Sizes(scenario=Scenario(), layouts=SMOKE_LAYOUTS, apply_calls=20,
                     load_ranks=(2,))
    # the eight layouts of vLLM 0.11.0 (LAYOUTS also holds the oracle design's one-sided
    # dispatch, which 0.11.0 refuses as an all2all backend)
    return Sizes(scenario=Scenario(tokens=64), layouts=LAYOUT_NAMES, apply_calls=1000,
                 load_ranks=(2, 4))


def emulator_rows(smoke: bool, gpu_json: Path, raw: dict) -> list[Row]:
    from benchmarks import emulator_device as ed

    shape = ({"experts": 8, "hidden": 256, "intermediate": 512, "top_k": 2} if smoke
             else dict(ed.DEEPSEEK))
    tokens = (16,) if smoke else (16, 256)
    # CPU: the first 8 experts' work, scaled to 256 (emulator_device.py explains why).
    cpu = ed.run("cpu", tokens, chunk=8, experts_timed=8, shape=shape)
    gpu = None
    if gpu_json.exists():
        gpu = json.loads(gpu_json.read_text())
        if gpu.get("shape") != shape:
            gpu = None
    raw["emulator"] = {"cpu": cpu, "gpu": gpu, "gpu_json": str(gpu_json)}
    by_tokens = {r["tokens"]: r for r in (gpu or {}).get("results", [])}
    label = "not run" if gpu is None else f"{gpu['device_name']} {gpu['date'][:10]}"
    rows = []
    for r in cpu["results"]:
        g = by_tokens.get(r["tokens"])
        for what in ("emulator", "reference"):
            rows.append(Row(7, f"{what}, E={shape['experts']} H={shape['hidden']} "
                               f"I={shape['intermediate']}, tokens={r['tokens']}", "s",
                            g[f"{what}_s"] if g else None, r[f"{what}_s"],
                            "CPU (this machine)", "info", None,
                            {"gpu": label, "cpu_extrapolated_from_experts":
                             r["experts_timed"] if r["extrapolated"] else None}))
    return rows


def collect(smoke: bool, items, gpu_json: Path, raw: dict) -> list[Row]:
    rows: list[Row] = []
    if 1 in items:
        from benchmarks import startup
        rows += startup.rows(runs=1 if smoke else 5)
    if any(i in items for i in (2, 3, 4, 6)):
        from benchmarks import accuracy, layout_runs, load_time, overhead, quant_work

        sizes = _layout_sizes(smoke)
        results = layout_runs.run_all(sizes)
        if 2 in items:
            rows += overhead.rows(results, sizes.apply_calls)
        if 3 in items:
            rows += quant_work.rows(results, max(sizes.spreads))
        if 4 in items:
            errs = accuracy.errors(results, sizes.scenario, sizes.spreads)
            raw["errors"] = {k: {str(s): v for s, v in d.items()} for k, d in errs.items()}
            rows += accuracy.rows(errs)
            rows.append(accuracy.seed_sweep_row(sizes.scenario, sizes.spreads,
                                                range(2) if smoke else range(6)))
        if 6 in items:
            rows += load_time.rows(results, sizes.load_ranks)
    if 5 in items:
        from benchmarks import audit_time
        rows += audit_time.rows(repeats=1 if smoke else 3)
    if 7 in items:
        rows += emulator_rows(smoke, gpu_json, raw)
    return sorted(rows, key=lambda r: r.item)


def collect_oracle(smoke: bool, items, raw: dict) -> list[Row]:
    """The NVFP4-oracle world's rows: items 1, 2, 3, 4, 6, 8."""
    from benchmarks import engine_level, oracle_rows, oracle_runs

    rows: list[Row] = []
    if 1 in items:
        from benchmarks import startup
        rows += startup.rows(runs=1 if smoke else 5)
    sizes = oracle_runs.smoke_sizes() if smoke else oracle_runs.OracleSizes()
    if any(i in items for i in (2, 3, 4, 6)):
        results = oracle_runs.run_all(sizes, items)
        dp2 = results.get("dp2", [])
        if 2 in items:
            rows += oracle_rows.apply_rows(results, sizes.apply_calls)
        if 3 in items:
            rows += oracle_rows.per_forward_rows(results, sizes.apply_calls)
        if 4 in items:
            acc, raw["accuracy"] = oracle_rows.accuracy_rows(dp2, oracle_rows.scenarios_of(sizes))
            rows += acc
        if 6 in items:
            rows += oracle_rows.load_rows(results)
            raw["load"] = {k: [r.get("load") for r in v] for k, v in results.items()}
    if 8 in items:
        rows += engine_level.rows(smoke, raw)
    return sorted(rows, key=lambda r: r.item)


def run_here(smoke: bool, items, gpu_json: Path) -> dict:
    """This interpreter's world: its rows, printed, and its JSON document."""
    world = worlds.current()
    t0 = time.perf_counter()
    raw: dict = {}
    if worlds.is_oracle():
        rows = collect_oracle(smoke, items & set(worlds.ORACLE_ITEMS), raw)
    else:
        rows = collect(smoke, items & set(worlds.LEGACY_ITEMS), gpu_json, raw)
    wall = time.perf_counter() - t0
    print(f"== {world} ({worlds.design_label()}) ==")
    print(format_table(rows))
    missed = [r for r in rows if r.ok is False]
    print(f"\n{len(rows)} rows, {len(missed)} MISSED, {wall:.0f} s "
          f"({'smoke' if smoke else 'full'}, {world})")
    for r in missed:
        print(f"MISSED: item {r.item}: {r.name} (target {r.target})"
              + (f": {r.extra['reason']}" if "reason" in r.extra else ""))
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "mode": "smoke" if smoke else "full", "wall_s": wall, "world": world,
            "design": worlds.design_label(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": sys.version.split()[0], "executable": sys.executable},
            "rows": [r.as_dict() for r in rows], "raw": raw}


def run_other(world: str, python: Path, argv: list[str]) -> dict:
    """Another world's rows, by that world's python running this checkout (``--worlds
    here``); its table is printed as it comes."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "world.json"
        env = dict(os.environ, PYTHONPATH=str(HERE.parent))
        cmd = [str(python), "-m", "benchmarks.run", *argv, "--worlds", "here",
               "--json", str(out)]
        proc = subprocess.run(cmd, cwd=HERE.parent, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{world}: {' '.join(cmd)} exited {proc.returncode}")
        return json.loads(out.read_text())["worlds"][world]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few layouts")
    ap.add_argument("--json", default=None,
                    help="output JSON (default benchmarks/results.json, "
                         "benchmarks/results-smoke.json with --smoke); other worlds' rows "
                         "already in it are kept")
    ap.add_argument("--items", default=",".join(map(str, ITEMS)),
                    help="comma-separated subset of items 1-8 (each world runs the ones it has)")
    ap.add_argument("--gpu-json", default=str(GPU_JSON),
                    help="item 7 GPU numbers from emulator_device.py --json")
    ap.add_argument("--worlds", choices=("all", "here"), default="all",
                    help="here: only the installed vLLM's world; all: also every other world "
                         "whose virtualenv exists under --venv-root")
    ap.add_argument("--venv-root", default=str(HERE.parent),
                    help="where the worlds' virtualenvs are (default: this checkout)")
    a = ap.parse_args(argv)
    items = {int(i) for i in a.items.split(",") if i}
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    path = Path(a.json) if a.json else HERE / ("results-smoke.json" if a.smoke
                                                else "results.json")
    docs = {worlds.current(): run_here(a.smoke, items, Path(a.gpu_json))}
    if a.worlds == "all":
        passthrough = (["--smoke"] if a.smoke else []) + [
            "--items", a.items, "--gpu-json", a.gpu_json]
        for world, python in worlds.other_worlds(Path(a.venv_root)):
            print()
            docs[world] = run_other(world, python, passthrough)
        missing = [w for w in worlds.WORLD_VENVS if w not in docs]
        for w in missing:
            print(f"\n{w}: not run, no {worlds.WORLD_VENVS[w]}/bin/python under {a.venv_root}")
    previous = {}
    if path.exists():
        try:
            previous = json.loads(path.read_text()).get("worlds", {})
        except (ValueError, AttributeError):
            previous = {}
    path.write_text(json.dumps({"worlds": {**previous, **docs}}, indent=2, default=str))
    print(f"wrote {path} (worlds: {', '.join(sorted({**previous, **docs}))})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
