# SPDX-License-Identifier: Apache-2.0
"""Task accuracy of the NVFP4 checkpoints through vLLM's OpenAI server and lm-eval.

One command makes the whole table; rows are engine release x checkpoint (format) x layout,
columns are

  bf16     the unquantized model the checkpoint was quantized from (accuracy/models/
           qwen3moe-add-bf16 or deepseekv3-add-bf16), same world and layout
  ideal    the NVFP4 checkpoint, plugin on, FP4_MOE_TEST_KERNEL=reference (the ideal NVFP4 MoE
           kernel: every expert's own scales, no emulated FlashInfer shortcut)
  stock    VLLM_FP4_MOE_PLUGIN=0 (the emulated SM100 FlashInfer CUTLASS path, as upstream runs it)
  plugin   VLLM_FP4_MOE_PLUGIN=1 (same path with the plugin)

Each cell is one server start (fp4_moe_lab.engines.server: loopback, bounded, always stopped) and
one lm-eval run of the task accuracy/lm_eval_task (local-completions against
http://127.0.0.1:PORT/v1/completions, greedy, exact match); the cell records n, correct,
accuracy and a 95 % Wilson interval. Results go to docs/data/accuracy.json after every cell, so the
command is resumable: cells already there are skipped unless --force. docs/ACCURACY.md's tables
and docs/data/accuracy.png are rewritten from the JSON (also alone: --report-only).

Usage (repository root; the engine worlds .venv-engine and .venv-engine-0.32.0 must exist):
  python accuracy/run_table.py                      # every row, most informative first
  python accuracy/run_table.py --limit 100 --rows 0.32.0:dp2ep:ct-all
  python accuracy/run_table.py --report-only
Run by .venv's Python (the lab installed; standard library only); lm-eval runs in the 0.32.0
world's Python
(FP4MOE_LM_EVAL_PYTHON overrides), the chart in a Python with matplotlib (FP4MOE_PLOT_PYTHON,
else the first of .venv-plot, .venv, the engine worlds that imports it).
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fp4_moe_lab.accuracy import cells, report
from fp4_moe_lab.accuracy.cells import (
    CHECKPOINTS,
    COLUMNS,
    LAYOUTS,
    MODELS,
    PRIORITY,
    REPO,
    TASK,
    TASK_DIR,
    bf16_of,
    cell_key,
    failure_reason,
    present_checkpoints,
)
from fp4_moe_lab.engines import server
from fp4_moe_lab.engines.engine import ACTIVE_LINE

# Per world: what a server needs besides server.serve()'s defaults. 0.11.0: the FlashInfer
# CUTLASS ("throughput") NVFP4 MoE path as engines/engine_run.py selects it; 0.32.0: the
# FlashInfer CUTLASS backend through the oracle (tests/engine/test_engine32_e2e.py).
# VLLM_SLEEP_WHEN_IDLE=1 (0.11.0): without it the two TP workers spin on sched_yield whenever
# they wait (shm_broadcast.SpinTimer) and starve every other process on two cores: a
# 200-problem TP=2+EP cell's lm-eval took 528-3475 s, with it 26-28 s (measured). Not proven
# numerically neutral (docs/ACCURACY.md, "Times"); each cell records it in the JSON's env.
WORLD_ENV = {
    "0.11.0": {"VLLM_USE_FLASHINFER_MOE_FP4": "1", "VLLM_FLASHINFER_MOE_BACKEND": "throughput",
               "VLLM_MLA_DISABLE": "1", "VLLM_SLEEP_WHEN_IDLE": "1"},
    "0.32.0": {},
}
WORLD_ARGS = {"0.11.0": (), "0.32.0": ("--moe-backend", "flashinfer_cutlass")}
# bf16 model: only the CPU platform (+ on 0.32.0 the CPU shims and the vec MoE kernel: the AMX
# one dies with SIGILL in the DP rank-1 worker here, docs/ENGINE-0.32.md)
# (0.11.0 with only the platform stops at "Found no NVIDIA driver": the simulated SM100 is
# what makes its CUDA-only paths CPU-safe, and it leaves unquantized layers alone)
BF16_ENV = {"0.11.0": {"FP4_MOE_TEST_SEAM": "1"},
            "0.32.0": {"FP4_MOE_TEST_SEAM": "cpu", "FP4_MOE_TEST_CPU_MOE_ISA": "vec"}}
# the patched engine world serves as its stock release does
for _table in (WORLD_ENV, WORLD_ARGS, BF16_ENV):
    _table["0.32.0-patched"] = _table["0.32.0"]


def wilson(k: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95 % Wilson score interval of k successes in n (Wilson 1927)."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    mid = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, mid - half), min(1.0, mid + half))


def lm_eval_python() -> str:
    env = os.environ.get("FP4MOE_LM_EVAL_PYTHON")
    if env:
        return env
    py = server.world_python("0.32.0")
    if py is None:
        raise SystemExit("no Python with lm-eval: build .venv-engine-0.32.0 "
                         "(scripts/bootstrap-engine.sh 0.32.0) or set FP4MOE_LM_EVAL_PYTHON")
    return str(py)


def run_lm_eval(base_url: str, model_name: str, tokenizer_dir: Path, limit: int,
                timeout_s: float) -> dict:
    """lm-eval's local-completions client on the task; returns n, correct and a few misses,
    read from the per-sample log (so n is what was really scored)."""
    out = Path(tempfile.mkdtemp(prefix="lm-eval-"))
    model_args = ",".join([
        f"model={model_name}", f"base_url={base_url}/v1/completions",
        f"tokenizer={tokenizer_dir}", "tokenizer_backend=huggingface",
        "tokenized_requests=True", "add_bos_token=True", "max_length=128",
        "num_concurrent=2", "max_retries=2", "timeout=120"])
    cmd = [lm_eval_python(), "-m", "lm_eval", "--model", "local-completions",
           "--model_args", model_args, "--tasks", TASK, "--include_path", str(TASK_DIR),
           "--limit", str(limit), "--batch_size", "8", "--output_path", str(out),
           "--log_samples"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false"})
    p = subprocess.run(cmd, cwd=str(REPO), env=env, capture_output=True, text=True,
                       timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"lm_eval failed ({p.returncode}):\n{p.stdout[-3000:]}\n"
                           f"{p.stderr[-3000:]}")
    samples = glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True)
    if len(samples) != 1:
        raise RuntimeError(f"expected one samples file under {out}, found {samples}")
    n = correct = 0
    misses = []
    with open(samples[0]) as f:
        for line in f:
            s = json.loads(line)
            n += 1
            ok = float(s["exact_match"]) == 1.0
            correct += ok
            if not ok and len(misses) < 5:
                got = s["filtered_resps"][0] if s.get("filtered_resps") else s.get("resps")
                misses.append({"prompt": s["doc"]["prompt"], "answer": s["doc"]["answer"],
                               "got": got})
    return {"n": n, "correct": correct, "misses": misses, "lm_eval_version": lm_eval_version()}


_LM_EVAL_VERSION = None


def lm_eval_version() -> str:
    global _LM_EVAL_VERSION
    if _LM_EVAL_VERSION is None:
        _LM_EVAL_VERSION = subprocess.run(
            [lm_eval_python(), "-c", "import importlib.metadata as m; print(m.version('lm_eval'))"],
            capture_output=True, text=True, timeout=120).stdout.strip()
    return _LM_EVAL_VERSION


def run_cell(world: str, layout: str, ckpt_dir: str, column: str, limit: int,
             log_dir: Path) -> dict:
    """One server start + one lm-eval run."""
    tp, dp, ep = LAYOUTS[layout]
    env_extra = dict(WORLD_ENV[world])
    model = MODELS / (bf16_of(ckpt_dir) if column == "bf16" else ckpt_dir)
    served = servable(model, world)
    plugin, kernel = {"bf16": ("0", "emulator"), "ideal": ("1", "reference"),
                      "stock": ("0", "emulator"), "plugin": ("1", "emulator")}[column]
    if column == "bf16":
        env_extra.update(BF16_ENV[world])
    t0 = time.monotonic()
    try:
        return _run_cell(world, layout, model, served, column, limit, log_dir, tp, dp, ep, plugin,
                         kernel, env_extra, t0)
    except Exception as e:
        # the server's error is usually far above the log tail the exception carries: name the
        # refusal from the whole log of this cell's server (the newest in log_dir)
        logs = sorted(log_dir.glob("server-*.log"), key=lambda f: f.stat().st_mtime)
        reason = failure_reason(logs[-1].read_text(errors="replace")) if logs else ""
        raise RuntimeError(f"{reason}\n{e}") from e


def _run_cell(world, layout, model, served, column, limit, log_dir, tp, dp, ep, plugin, kernel,
              env_extra, t0) -> dict:
    with server.serve(served, world=world, plugin=plugin, kernel=kernel, tp=tp, dp=dp, ep=ep,
                      extra_args=WORLD_ARGS[world] if column != "bf16" else (),
                      env_extra=env_extra, ready_timeout_s=600.0, log_dir=log_dir) as s:
        ready_s = s.ready_s
        t1 = time.monotonic()
        res = run_lm_eval(s.base_url, s.model(), model, limit, timeout_s=3600.0)
        eval_s = time.monotonic() - t1
        log = s.log()
    lo, hi = wilson(res["correct"], res["n"])
    res.update({
        "world": world, "layout": layout, "tp": tp, "dp": dp, "ep": ep, "column": column,
        "checkpoint": str(model.relative_to(REPO)),
        "served": str(served.relative_to(REPO)) if served != model else None,
        "plugin": plugin, "kernel": kernel,
        "env": {k: v for k, v in env_extra.items()},
        "extra_args": list(WORLD_ARGS[world] if column != "bf16" else ()),
        "accuracy": res["correct"] / res["n"] if res["n"] else None, "wilson95": [lo, hi],
        "ready_s": round(ready_s, 1), "eval_s": round(eval_s, 1),
        "wall_s": round(time.monotonic() - t0, 1),
        "plugin_active_lines": sum(ACTIVE_LINE in ln for ln in log.splitlines()),
        "ep_agreed_logged": "agreed over the EP group" in log,
        "moe_backend_lines": sorted({ln.split("] ", 1)[-1][:160] for ln in log.splitlines()
                                     if "NvFp4 MoE backend" in ln or "FlashInfer" in ln
                                     and "MoE" in ln})[:4],
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    })
    return res


def servable(model: Path, world: str) -> Path:
    """The checkpoint itself, or its derivation under accuracy/.derived/ (accuracy/
    experts_only.py says why): experts-only when the attention projections are NVFP4 too (no
    CPU kernel for those); for 0.11.0 a compressed-tensors config without the keys its
    compressed-tensors 0.11.0 rejects."""
    from fp4_moe_lab.accuracy import experts_only

    compat = world == "0.11.0"
    q = json.loads((model / "config.json").read_text()).get("quantization_config") or {}
    ct_keys = compat and q.get("quant_method") == "compressed-tensors"
    if not experts_only.attention_quantized(model) and not ct_keys:
        return model
    return experts_only.derive(
        model, MODELS / bf16_of(model.name),
        REPO / "accuracy" / ".derived" / f"{model.name}-experts-only{'-ct011' if compat else ''}",
        ct_compat_011=compat)


def hold_writer_lock(json_out: Path):
    """One writer per JSON: a second run_table on the same file would drop the first one's cells.

    ``save`` rewrites the whole file from this process's copy, so two concurrent runs lose
    cells silently. An exclusive ``flock`` (released by the OS when the process ends, even on
    SIGKILL) makes the second run stop at once, naming the first one's PID. Returns the open
    lock file, to be kept for the life of the run.
    """
    import fcntl
    import hashlib
    tag = hashlib.sha256(str(json_out.resolve()).encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"fp4-moe-run-table-{tag}.lock"
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise SystemExit(f"run_table: another run is writing {json_out} (pid {holder}); wait for "
                         f"it, or write a trial table with --json OTHER.json") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def materialize_edits() -> None:
    """The labelled edits are generated, not committed (accuracy/skew.py,
    accuracy/dead_scale.py, accuracy/gate_up_split.py: after the skew, which it may edit)."""
    from fp4_moe_lab.accuracy import dead_scale, gate_up_split, skew

    for src_name, factor in skew.OUTPUT_SHA256:
        skew.ensure(src_name, factor)
    for src_name, case in dead_scale.OUTPUT_SHA256:
        dead_scale.ensure(src_name, case)
    for src_name in gate_up_split.OUTPUT_SHA256:
        gate_up_split.ensure(src_name)


def plan(rows_filter: list[str] | None, columns: tuple) -> list[tuple[str, str, str, str]]:
    """(world, layout, checkpoint dir, column) in run order."""
    out = []
    for world, layout in PRIORITY:
        for d, name, _fmt in present_checkpoints():
            if rows_filter and not any(_match(f, world, layout, name) for f in rows_filter):
                continue
            for col in columns:
                out.append((world, layout, d, col))
    return out


def _match(pattern: str, world: str, layout: str, name: str) -> bool:
    parts = (pattern.split(":") + ["*", "*", "*"])[:3]
    return all(p in ("*", "") or p == v for p, v in zip(parts, (world, layout, name)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=500, help="problems per cell (default 500)")
    ap.add_argument("--rows", default="", help="comma list of WORLD:LAYOUT:CHECKPOINT patterns "
                    "(* or empty = any), e.g. 0.32.0:dp2ep:ct-all,0.11.0:single")
    ap.add_argument("--columns", default=",".join(COLUMNS))
    ap.add_argument("--force", action="store_true", help="re-run cells already in the JSON")
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--max-cells", type=int, default=0, help="stop after this many new cells")
    ap.add_argument("--json", type=Path, default=None,
                    help="write cells to this JSON, not docs/data/accuracy.json (a trial run; "
                         "the published table, chart and JSON are left alone)")
    args = ap.parse_args()
    trial = args.json is not None
    json_out = args.json.resolve() if trial else cells.JSON_OUT
    # a plain `kill` must still stop the server's process group (server.serve's finally)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    lock = hold_writer_lock(json_out)  # noqa: F841  (held until the process ends)

    materialize_edits()
    data = cells.load(json_out)
    todo = [] if args.report_only else plan([r for r in args.rows.split(",") if r],
                                            tuple(c for c in args.columns.split(",") if c))
    log_dir = Path(tempfile.mkdtemp(prefix="accuracy-servers-"))
    done = 0
    measured: set[str] = set()
    t_all = time.monotonic()
    for i, (world, layout, d, col) in enumerate(todo):
        name = CHECKPOINTS[d][0]
        key = cell_key(world, layout, name, col)
        if key in data["cells"] and (not args.force or key in measured):
            # (a bf16 cell is shared by every checkpoint of its model: measured once per run)
            print(f"[{i+1}/{len(todo)}] {key}: in {json_out.name}, skipped", flush=True)
            continue
        if args.max_cells and done >= args.max_cells:
            break
        print(f"[{i+1}/{len(todo)}] {key}: serving ...", flush=True)
        try:
            cell = run_cell(world, layout, d, col, args.limit, log_dir)
        except Exception as e:  # record the failure, keep going with the next cell
            print(f"    FAILED: {str(e)[-1500:]}", flush=True)
            data.setdefault("failures", {})[key] = {
                "error": str(e)[-3000:], "reason": failure_reason(str(e)),
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            cells.save(data, json_out)
            continue
        data["cells"][key] = cell
        measured.add(key)
        data.get("failures", {}).pop(key, None)
        done += 1
        cells.save(data, json_out)
        print(f"    {report.fmt_cell(cell)}  ready {cell['ready_s']:.0f} s, "
              f"eval {cell['eval_s']:.0f} s, cell {cell['wall_s']:.0f} s "
              f"(elapsed {(time.monotonic()-t_all)/60:.1f} min)", flush=True)
    cells.save(data, json_out)
    if trial:
        print(f"wrote {json_out} (trial: docs/ACCURACY.md and the chart unchanged)")
        return 0
    report.write_markdown(data)
    cells.save(data, json_out)  # with the audit verdicts write_markdown recorded
    print("chart:", report.write_chart(data))
    print(f"wrote {json_out.relative_to(REPO)}, {cells.MD_OUT.relative_to(REPO)}, "
          f"{cells.PNG_OUT.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
