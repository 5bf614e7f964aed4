# SPDX-License-Identifier: Apache-2.0
"""The load-time EP scale agreement at 2, 4 and 8 ranks, torch only (no vLLM needed).

What the plugin adds at load under DP+EP, per rank: one ``scale_agreement.agree_max`` per MoE layer
(a progress key in the world's rendezvous store, then one MAX all-reduce of one float over a gloo
group, its wait bounded by the timeout), next to as many bare gloo all-reduces and as many
``dist.barrier`` round trips, and the agreement's earlier form (a gloo ``monitored_barrier`` before
each all-reduce: "monitored"). DeepSeek-R1 has 58 MoE layers. Each rank is a spawned process in a
gloo world over TCP on loopback, as vLLM's CPU groups are. Prints one JSON line per world size: the
worst rank's median over ``--repeats`` interleaved runs, in ms.

    python -m benchmarks.agreement_scaling --ranks 2 4 8 [--layers 58] [--repeats 5]

(from the repository root, which puts the plugin's checkout on the path where it is not
installed)

Runs anywhere torch does: on this repository's CPU machine (2 cores: 8 ranks share them) and on
a host with a core per rank (the device tool's H200 host, 16 cores), to separate the
agreement's own cost from core contention.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, layers: int, repeats: int, queue) -> None:
    import torch
    import torch.distributed as dist

    from vllm_fp4_moe_plugin.scales import scale_agreement

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.new_group(list(range(world)), backend="gloo")  # vLLM's cpu_group is one too
    g = torch.Generator().manual_seed(11 + rank)
    amax = [1 + 3 * torch.rand(256 // world, generator=g) for _ in range(layers)]
    runs: dict = {"agree": [], "all_reduce": [], "barrier": [], "monitored": []}
    for _ in range(repeats):  # interleaved, so drift hits all three
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for i, a in enumerate(amax):
            scale_agreement.agree_max(a, group, layer=f"model.layers.{i + 3}.mlp.experts")
        runs["agree"].append(time.perf_counter() - t0)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for a in amax:
            dist.all_reduce(a.max().reshape(1), op=dist.ReduceOp.MAX, group=group)
        runs["all_reduce"].append(time.perf_counter() - t0)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(layers):
            dist.barrier(group=group)
        runs["barrier"].append(time.perf_counter() - t0)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for a in amax:  # the agreement as it was before: a monitored barrier, then the all-reduce
            dist.monitored_barrier(group=group, wait_all_ranks=True)
            dist.all_reduce(a.max().reshape(1), op=dist.ReduceOp.MAX, group=group)
        runs["monitored"].append(time.perf_counter() - t0)
    queue.put((rank, {k: statistics.median(v) for k, v in runs.items()}))
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, layers: int, repeats: int) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, layers, repeats, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    per_rank = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    worst = {k: 1e3 * max(r[k] for r in per_rank.values())
             for k in ("agree", "all_reduce", "barrier", "monitored")}
    return {"ranks": world, "layers": layers, "repeats": repeats, "cpus": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], **{f"{k}_ms": round(v, 2)
                                                   for k, v in worst.items()}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    for world in args.ranks:
        print(json.dumps(measure(world, args.layers, args.repeats)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
