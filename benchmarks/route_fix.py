# SPDX-License-Identifier: Apache-2.0
"""Item 9: what vLLM CUTLASS's route fix adds to every call of ``run_cutlass_moe_fp4`` under EP.

Why: the fix (``patches/nvfp4_oracle/non_local_routes.py``) runs on every forward of every MoE
layer with an expert map (``--moe-backend cutlass`` under EP, vLLM 0.32.0+). Its first form zeroed
GEMM2's whole output region (``m x topk x k`` elements of ``workspace13``) and bound a Python
signature per call; the non-local routes read one row. This measures both forms side by side at
DeepSeek-R1 shapes (k = 7168, top-8, 256 experts over EP = 8) under DP+EP, where ``m`` is every
rank's tokens gathered: decode (1-256) and prefill (2048-8192).

What is timed: the wrapper around a no-op kernel call, so only what the fix adds (its torch ops
and Python) is measured; the GEMMs are stock's and the same either way. ``--device cuda`` times
it on a GPU (torch only, no vLLM needed), eagerly and replayed from a CUDA graph (``--graph``:
the form vLLM serves decode in). With vLLM 0.34.0 installed, ``--host-stock`` also times stock's
own ``run_cutlass_moe_fp4`` host code (its CUDA ops replaced by no-ops) for the ratio to stock.

    python -m benchmarks.route_fix --device cuda --graph --json route_fix.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from vllm_fp4_moe_plugin.patches.nvfp4_oracle import non_local_routes

R1 = {"k": 7168, "n": 2048, "topk": 8, "experts": 256, "ep": 8, "moe_layers": 58}
TOKENS = (1, 32, 256, 2048, 8192)


def first_form(original):
    """The fix as first shipped (kept here to measure against): signature bound per call, GEMM2's
    whole output region of workspace13 zeroed, weights masked."""
    import inspect

    signature = inspect.signature(original)

    def wrapped(*args, **kwargs):
        call = dict(signature.bind(*args, **kwargs).arguments if args else kwargs)
        if call.get("expert_map") is None:
            return original(*args, **kwargs)
        topk_ids, weights = call["topk_ids"], call["topk_weights"]
        local = non_local_routes.local_routes(topk_ids, call["expert_map"])
        call["topk_weights"] = torch.where(local, weights, torch.zeros(
            (), dtype=weights.dtype, device=weights.device))
        rows = call["m"] * topk_ids.size(1) * call["k"]
        call["workspace13"].view(-1)[:rows].zero_()
        return original(**call)

    return wrapped


def kernel_stub(output, a, a1_gscale, w1_fp4, w1_blockscale, w1_alphas, a2_gscale, w2_fp4,
                w2_blockscale, w2_alphas, topk_weights, topk_ids, activation, workspace13,
                workspace2, m, n, k, e, device, apply_router_weight_on_input=False,
                expert_map=None, *, activation_config=None):
    """``run_cutlass_moe_fp4``'s signature, doing nothing: the GEMMs are stock's either way."""


def make_call(m: int, device, shape=R1) -> dict:
    k, n, topk, experts, ep = shape["k"], shape["n"], shape["topk"], shape["experts"], shape["ep"]
    g = torch.Generator(device="cpu").manual_seed(m)
    local_n = experts // ep
    expert_map = torch.full((experts,), -1, dtype=torch.int32)
    expert_map[:local_n] = torch.arange(local_n, dtype=torch.int32)  # rank 0 of EP
    ids = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(m)])
    ws13 = torch.empty(m * topk * max(2 * n, k), dtype=torch.bfloat16, device=device)
    return dict(output=torch.empty(m, k, dtype=torch.bfloat16, device=device),
                a=torch.empty(m, k, dtype=torch.bfloat16, device=device), a1_gscale=None,
                w1_fp4=None, w1_blockscale=None, w1_alphas=None, a2_gscale=None, w2_fp4=None,
                w2_blockscale=None, w2_alphas=None,
                topk_weights=torch.rand(m, topk, generator=g).to(device),
                topk_ids=ids.to(torch.int32).to(device), activation=None, workspace13=ws13,
                workspace2=torch.empty(m * topk * n, dtype=torch.bfloat16, device=device), m=m,
                n=n, k=k,
                e=local_n, device=torch.device(device), apply_router_weight_on_input=False,
                expert_map=expert_map.to(device))


def weights(device, shape=R1) -> dict:
    """Uninitialised NVFP4 weights of one rank's experts, shaped as vLLM's asserts want them."""
    e, n, k = shape["experts"] // shape["ep"], shape["n"], shape["k"]
    u8, fp8, f32 = torch.uint8, torch.float8_e4m3fn, torch.float32
    return dict(w1_fp4=torch.empty(e, 2 * n, k // 2, dtype=u8, device=device),
                w1_blockscale=torch.empty(e, 2 * n, k // 16, dtype=fp8, device=device),
                w1_alphas=torch.ones(e, dtype=f32, device=device),
                a1_gscale=torch.ones(e, dtype=f32, device=device),
                a2_gscale=torch.ones(e, dtype=f32, device=device),
                w2_fp4=torch.empty(e, k, n // 2, dtype=u8, device=device),
                w2_blockscale=torch.empty(e, k, n // 16, dtype=fp8, device=device),
                w2_alphas=torch.ones(e, dtype=f32, device=device))


def bytes_written(form: str, m: int, shape=R1) -> int:
    """Device bytes the fix writes per call: workspace rows (bf16), the route mask (bool), the
    masked weights (fp32) where the form writes them, the row index."""
    routes, k = m * shape["topk"], shape["k"]
    if form == "stock":
        return 0
    if form == "first":
        return routes * k * 2 + routes * (1 + 4)
    call = {"n": shape["n"], "k": k}  # gated: w1_n = 2n
    weights = routes * 4 if non_local_routes.gemm1_may_write_the_row(call) else 0
    return k * 2 + routes + weights + 8


def _time(fn, call: dict, *, device: str, repeat: int, graph: bool) -> float:
    """Median microseconds per call."""
    if device == "cuda":
        torch.cuda.synchronize()
        if graph:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    fn(**call)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(**call)
            run = g.replay
        else:
            def run():
                fn(**call)
        for _ in range(10):
            run()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(repeat):
                run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3 / repeat)
        return statistics.median(samples)
    for _ in range(5):
        fn(**call)
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn(**call)
        samples.append((time.perf_counter() - t0) * 1e6 / repeat)
    return statistics.median(samples)


def stock_host_function():
    """vLLM's own ``run_cutlass_moe_fp4`` with its CUDA ops made no-ops (host code only), or
    None where vLLM (0.32.0+) is not installed."""
    try:
        from vllm.model_executor.layers.fused_moe.activation import MoEActivation
        from vllm.model_executor.layers.fused_moe.experts import cutlass_moe
    except ImportError:
        return None, None

    class NoOps:
        def get_cutlass_moe_mm_data(self, *a, **k):
            pass

        def shuffle_rows(self, x, index):
            return x[: index.numel()]

        def scaled_fp4_experts_quant(self, x, *a, **k):
            return x, None

        silu_and_mul_scaled_fp4_experts_quant = scaled_fp4_experts_quant

        def cutlass_fp4_moe_mm(self, *a, **k):
            pass

    cutlass_moe.ops = NoOps()
    cutlass_moe.remap_topk_to_local = lambda ids, emap, out_dtype=None: ids
    return cutlass_moe.run_cutlass_moe_fp4, MoEActivation.SILU


def measure(device: str, tokens=TOKENS, *, graph: bool = False, host_stock: bool = False,
            repeat: int = 50) -> list[dict]:
    rows = []
    stock_fn, silu = stock_host_function() if host_stock else (None, None)
    for m in tokens:
        call = make_call(m, device)
        forms = {"stock": kernel_stub, "first": first_form(kernel_stub),
                 "now": non_local_routes.build(kernel_stub)}
        for mode in (("eager", "graph") if graph and device == "cuda" else ("eager",)):
            row = {"tokens": m, "device": device, "mode": mode}
            for name, fn in forms.items():
                row[f"{name}_us"] = _time(fn, call, device=device, repeat=repeat,
                                          graph=mode == "graph")
                row[f"{name}_bytes"] = bytes_written(name, m)
            for name in ("first", "now"):
                row[f"{name}_added_us"] = row[f"{name}_us"] - row["stock_us"]
                row[f"{name}_added_per_step_ms"] = row[f"{name}_added_us"] * R1["moe_layers"] / 1e3
            if stock_fn is not None and device == "cpu":
                real = dict(call, activation=silu, a=call["a"].clone(), **weights(device))
                row["stock_host_us"] = _time(stock_fn, real, device=device, repeat=repeat,
                                             graph=False)
                row["now_host_us"] = _time(non_local_routes.build(stock_fn), real,
                                           device=device, repeat=repeat, graph=False)
                row["ratio_to_stock"] = row["now_host_us"] / row["stock_host_us"]
            rows.append(row)
    return rows


def timing_parser(doc: str, tokens) -> argparse.ArgumentParser:
    """The options every per-call timing here takes."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--graph", action="store_true", help="also replay from a CUDA graph")
    ap.add_argument("--tokens", type=int, nargs="+", default=list(tokens))
    ap.add_argument("--repeat", type=int, default=50)
    ap.add_argument("--json", help="write the rows and the machine here")
    return ap


def main(argv=None) -> int:
    ap = timing_parser(__doc__, TOKENS)
    ap.add_argument("--host-stock", action="store_true",
                    help="also time vLLM's own run_cutlass_moe_fp4 host code (vLLM 0.32.0+)")
    args = ap.parse_args(argv)
    rows = measure(args.device, args.tokens, graph=args.graph, host_stock=args.host_stock,
                   repeat=args.repeat)
    for r in rows:
        print(json.dumps(r))
    if args.json:
        save_json(args.json, R1, args.device, rows)
    return 0


def save_json(path: str, shape: dict, device: str, rows: list[dict]) -> None:
    """The rows, the shape they were timed at and the machine (GPU name on CUDA)."""
    machine = {"platform": platform.platform(), "torch": torch.__version__,
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
                   timespec="minutes")}
    if device == "cuda":
        machine["gpu"] = torch.cuda.get_device_name()
    with open(path, "w") as f:
        json.dump({"shape": shape, "machine": machine, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    raise SystemExit(main())
