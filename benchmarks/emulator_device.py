# SPDX-License-Identifier: Apache-2.0
"""Item 7: the NVFP4 emulator and reference on a DeepSeek-shaped layer, on one device.

Why: the test suite's cost at real sizes. Shape: E=256, H=7168, I=2048, top-8 (DeepSeek-R1's
routed experts). Runs on an image with torch only (no vLLM / FlashInfer / compressed-tensors):
it imports nothing but ``fp4_moe_lab.nvfp4``, which is pure torch.

Memory: ``nvfp4.cutlass_fused_moe`` decodes *every* local expert's weights to fp64 per call
(``_nvfp4_operands``), ~90 GB for this shape, and the fp32 reference dequantizes every expert
(~45 GB). So the layer is run in expert chunks of ``--chunk`` experts, each chunk exactly as an
EP rank would run it (``ep_size = E/chunk``, ``ep_rank`` = chunk index; reference on the
``experts_slice``); the layer's time is the sum over chunks, the same work as one unchunked
call. ``--experts-timed N`` times only the first N experts' chunks and scales the sum by E/N
(reported as extrapolated): the per-expert work is weight decoding, which does not depend on
routing. Kernel-argument preparation (``to_flashinfer_inputs``: [w3; w1] concat and 128x4
swizzle) is timed separately and is not in the emulator number.

    python -m benchmarks.emulator_device --device cuda --json emu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import time

import torch

from fp4_moe_lab.nvfp4 import (
    QuantizedExperts,
    cutlass_fused_moe,
    moe_reference_nvfp4,
    to_flashinfer_inputs,
)

DEEPSEEK = {"experts": 256, "hidden": 7168, "intermediate": 2048, "top_k": 8}


def random_packed_experts(n: int, hidden: int, inter: int, *, seed: int,
                          device) -> QuantizedExperts:
    """Random FP4 codes and E4M3 block scales (no master weights: they would need ~45 GB)."""
    g = torch.Generator(device=device).manual_seed(seed)

    def codes(*shape):
        return torch.randint(0, 256, shape, generator=g, device=device, dtype=torch.uint8)

    def sf(*shape):  # block scales in [64, 448): dequantized weights ~0.01-0.05, no zeros
        u = torch.rand(shape, generator=g, device=device)
        return (64 + 384 * u).to(torch.float8_e4m3fn)

    def gs(base):  # per-expert global scales, 1x..4x spread
        return (base / (1 + 3 * torch.rand(n, generator=g, device=device))).float()

    return QuantizedExperts(
        w1=codes(n, inter, hidden // 2), w1_sf=sf(n, inter, hidden // 16),
        w3=codes(n, inter, hidden // 2), w3_sf=sf(n, inter, hidden // 16),
        w2=codes(n, hidden, inter // 2), w2_sf=sf(n, hidden, inter // 16),
        w13_weight_gs=gs(2688.0 / 0.05), w2_weight_gs=gs(2688.0 / 0.05),
        w13_input_gs=gs(2688.0 / 64), w2_input_gs=gs(2688.0 / 256))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_layer(tokens: int, *, experts: int, hidden: int, intermediate: int, top_k: int,
               chunk: int, experts_timed: int, device, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + tokens)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).to(device)
    probs = torch.softmax(torch.randn(tokens, experts, generator=g), dim=-1)
    w, ids = probs.topk(top_k, dim=-1)
    w = (w / w.sum(-1, keepdim=True)).float().to(device)
    ids = ids.to(torch.int32).to(device)
    n_chunks = experts // chunk
    timed = max(1, min(n_chunks, -(-experts_timed // chunk)))
    t_emu = t_ref = t_prep = 0.0
    emu_sum = torch.zeros(tokens, hidden, dtype=torch.float32, device=device)
    ref_sum = torch.zeros_like(emu_sum)
    for c in range(timed):
        part = random_packed_experts(chunk, hidden, intermediate, seed=seed * 1000 + c,
                                     device=device)
        _sync(device)
        t0 = time.perf_counter()
        kw = to_flashinfer_inputs(part, a1_gs=part.w13_input_gs)
        _sync(device)
        t1 = time.perf_counter()
        out = cutlass_fused_moe(x, ids, w, output_dtype=torch.bfloat16, ep_size=n_chunks,
                                ep_rank=c, **kw)[0]
        _sync(device)
        t2 = time.perf_counter()
        ref = moe_reference_nvfp4(x, part, w, ids.long() - c * chunk,
                                  a1_gs=part.w13_input_gs, intermediate_dtype=torch.bfloat16)
        _sync(device)
        t3 = time.perf_counter()
        t_prep, t_emu, t_ref = t_prep + t1 - t0, t_emu + t2 - t1, t_ref + t3 - t2
        emu_sum += out.float()
        ref_sum += ref
        del part, kw, out, ref
    scale = n_chunks / timed
    diff = float((emu_sum.double() - ref_sum.double()).norm()
                 / ref_sum.double().norm().clamp_min(1e-30))
    return {"tokens": tokens, "emulator_s": t_emu * scale, "reference_s": t_ref * scale,
            "prep_s": t_prep * scale, "experts_timed": timed * chunk, "chunk": chunk,
            "extrapolated": timed < n_chunks, "emulator_vs_reference_rel": diff}


def run(device: str, tokens, *, chunk: int, experts_timed: int, shape: dict) -> dict:
    dev = torch.device(device)
    # warm-up, untimed: CUDA context / thread pools, allocator, kernel selection
    time_layer(8, **{**shape, "experts": chunk, "hidden": 256, "intermediate": 512},
               chunk=chunk, experts_timed=chunk, device=dev)
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        cap = ".".join(map(str, torch.cuda.get_device_capability(dev)))
        torch.cuda.reset_peak_memory_stats(dev)
    else:
        name, cap = platform.processor() or platform.machine(), None
    results = [time_layer(t, **shape, chunk=chunk, experts_timed=experts_timed, device=dev)
               for t in tokens]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device, "device_name": name, "capability": cap,
        "torch": torch.__version__, "threads": torch.get_num_threads(), "shape": shape,
        "peak_gpu_mem_gib": (torch.cuda.max_memory_allocated(dev) / 2**30
                             if dev.type == "cuda" else None),
        "results": results,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 256, 4096])
    ap.add_argument("--chunk", type=int, default=32, help="experts per emulator call")
    ap.add_argument("--experts-timed", type=int, default=None,
                    help="time only this many experts and extrapolate (default: all)")
    ap.add_argument("--smoke", action="store_true", help="E=8, H=256, I=512, top-2")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    shape = ({"experts": 8, "hidden": 256, "intermediate": 512, "top_k": 2} if a.smoke
             else dict(DEEPSEEK))
    chunk = min(a.chunk, shape["experts"])
    res = run(a.device, a.tokens, chunk=chunk,
              experts_timed=a.experts_timed or shape["experts"], shape=shape)
    for r in res["results"]:
        print(f"{res['device_name']} tokens={r['tokens']:>5}  emulator {r['emulator_s']:.3f} s"
              f"  reference {r['reference_s']:.3f} s  prep {r['prep_s']:.3f} s  experts timed "
              f"{r['experts_timed']}{' (extrapolated)' if r['extrapolated'] else ''}  "
              f"emu-vs-ref {r['emulator_vs_reference_rel']:.2e}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
