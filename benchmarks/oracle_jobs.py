# SPDX-License-Identifier: Apache-2.0
"""Jobs that run inside simulated ranks of the NVFP4-oracle world (vLLM 0.14.0+; CI: 0.34.0).

The 0.34.0 twin of :mod:`benchmarks.jobs`: one job per spawned group does everything that group
is asked for (``spec`` keys ``accuracy``, ``forward``, ``load``), because starting vLLM in a
fresh process is the expensive part. Every layer is vLLM's own (``simulation.moe_layer``:
``FusedMoEFactory`` -> ``MoERunner``/``RoutedExperts``, its loader, ``process_weights_after_
loading`` with the backend oracle); only SM100 and FlashInfer are simulated.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks import oracle_seam
from fp4_moe_lab.simulation import moe_layer
from fp4_moe_lab.simulation.layouts import describe_layer
from vllm_fp4_moe_plugin.patches import ledger
from vllm_fp4_moe_plugin.scales import scale_agreement

_index = iter(range(3000, 100000))  # unique layer names: vLLM refuses a duplicate prefix

FORMATS = ("compressed-tensors", "modelopt")


def _switch(mode: str) -> None:
    (ledger.apply_all if mode == "plugin" else ledger.revert_all)()


def _build(experts, fmt: str, mode: str, top_k: int, process: bool = True):
    _switch(mode)
    return moe_layer.build_layer(experts, fmt, top_k=top_k, index=next(_index),
                                 process=process).layer


def _call(layer, x, logits):
    return (layer.forward_native if hasattr(layer, "forward_native") else layer.forward)(
        x, logits)


def _across(ctx, tokens: int):
    dp = ctx.layout.dp
    return torch.tensor([tokens] * dp) if dp > 1 else None


def accuracy(ctx, scenarios) -> dict:
    """Per scenario (one EP-slice ratio each): outputs and scales of compressed-tensors stock
    and plugin and ModelOpt stock and plugin, on this rank's tokens."""
    out: dict = {}
    try:
        for sc in scenarios:
            experts = sc.experts()
            x, logits = sc.inputs(ctx.dp_rank)
            res = {}
            for fmt in FORMATS:
                for mode in ("stock", "plugin"):
                    layer = _build(experts, fmt, mode, sc.top_k)
                    y = moe_layer.forward(layer, x, logits, vllm_config=ctx.vllm_config,
                                          num_tokens_across_dp=_across(ctx, sc.tokens))
                    res[f"{fmt}/{mode}"] = {"output": y.float(), "info": describe_layer(layer)}
            out[sc.slice_ratio] = res
    finally:
        ledger.revert_all()
    return out


def forward_work(ctx, scenario, token_counts, calls: int, count_tokens: int) -> dict:
    """The plugin does nothing per forward: (a) calls of the wrapped oracle helpers, their stock
    originals and the EP collective, counted at load and over ``calls`` forwards per layer;
    (b) median host time of one forward of the compressed-tensors layer (the one the plugin
    changes under DP+EP), device work no-ops: two stock and two plugin layers, so that each
    side has its own A/A pair (two layers of identical code differ by their memory, their
    place in the rotation...: that is the noise floor a plugin/stock ratio is read against)."""
    from vllm.forward_context import get_forward_context, set_forward_context

    experts = scenario.experts()
    ledger.apply_all()
    watched = oracle_seam.helper_functions()
    names = ("stock", "plugin", "stock#2", "plugin#2")
    layers, at_load = {}, {}
    for s in names:
        with oracle_seam.counting_calls(watched) as n:
            layers[s] = _build(experts, "compressed-tensors", s.split("#")[0], scenario.top_k)
        at_load[s] = dict(n)
    g = torch.Generator().manual_seed(5)
    res: dict = {"at_load": at_load, "per_forward": {}, "samples": {}, "blocks": {}}
    with oracle_seam.host_only():
        for m in token_counts:
            x = torch.randn(m, scenario.hidden, generator=g).to(torch.bfloat16)
            logits = torch.randn(m, scenario.num_experts, generator=g).to(torch.bfloat16)
            with set_forward_context({}, ctx.vllm_config, num_tokens=m,
                                     num_tokens_across_dp=_across(ctx, m)):
                moe_layer.moe_layers_by_name(get_forward_context())  # layers called one by one
                for s, layer in layers.items():  # warm up
                    _switch(s.split("#")[0])
                    for _ in range(3):
                        _call(layer, x, logits)
                if m == count_tokens:
                    for s, layer in layers.items():
                        _switch(s.split("#")[0])
                        with oracle_seam.counting_calls(watched) as n:
                            for _ in range(calls):
                                _call(layer, x, logits)
                        res["per_forward"][s] = {"forwards": calls, **n}
                res["samples"][m], res["blocks"][m] = _timed_blocks(layers, x, logits, calls)
    ledger.revert_all()
    return res


def _timed_blocks(layers: dict, x, logits, calls: int):
    """Blocks of calls per layer, interleaved and rotating so drift hits every layer alike;
    patches switch only between blocks (2 untimed calls after each switch). Returns every
    call's time per layer and the per-block medians (the A/A noise floor is computed from
    those)."""
    order = list(layers.items())
    block = max(1, min(50, calls // 4))
    samples = {s: [] for s in layers}
    blocks = {s: [] for s in layers}
    for i in range(-(-calls // block)):
        k = i % len(order)
        for s, layer in order[k:] + order[:k]:
            _switch(s.split("#")[0])
            for _ in range(2):
                _call(layer, x, logits)
            times = []
            for _ in range(block):
                t0 = time.perf_counter()
                _call(layer, x, logits)
                times.append(time.perf_counter() - t0)
            samples[s] += times
            blocks[s].append(statistics.median(times))
    return samples, blocks


def load_cost(ctx, num_layers: int, num_experts: int, experts=None, pwal_layers: int = 0,
              top_k: int = 8, repeats: int = 3) -> dict:
    """What the plugin adds at load, per rank (median of ``repeats``): ``num_layers`` x
    ``scale_agreement.agree_max`` (the wrapper's one MAX all-reduce of one float over the EP
    group's CPU group, after a progress key in the rendezvous store), next to as many bare
    all-reduces and as many plain ``dist.barrier`` round trips; and the layer's own
    ``process_weights_after_loading`` (compressed-tensors, ``experts``: all ``num_experts``)
    timed on ``pwal_layers`` real layers stock and with the plugin (which then runs the
    agreement inside it)."""
    import torch.distributed as dist
    from vllm.distributed import get_ep_group

    group = get_ep_group().cpu_group
    world = dist.get_world_size(group)
    e_local = num_experts // world
    g = torch.Generator().manual_seed(11 + ctx.rank)
    amax = [448 * 6 / (256 * (1 + 3 * torch.rand(e_local, generator=g)))
            for _ in range(num_layers)]
    runs: dict = {"agree": [], "all_reduce": [], "barrier": []}
    for _ in range(repeats):  # interleaved, so drift on the shared machine hits all three
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for li, a in enumerate(amax):
            scale_agreement.agree_max(a, group, layer=f"model.layers.{li + 3}.mlp.experts")
        runs["agree"].append(time.perf_counter() - t0)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for a in amax:  # the agreement without its progress key
            dist.all_reduce(a.max().reshape(1), op=dist.ReduceOp.MAX, group=group)
        runs["all_reduce"].append(time.perf_counter() - t0)
        dist.barrier(group=group)
        t0 = time.perf_counter()
        for _ in range(num_layers):
            dist.barrier(group=group)
        runs["barrier"].append(time.perf_counter() - t0)
    t_agree, t_allreduce, t_barrier = (statistics.median(runs[k])
                                       for k in ("agree", "all_reduce", "barrier"))
    out = {"world": world, "e_local": e_local, "agree": t_agree, "all_reduce": t_allreduce,
           "barrier": t_barrier, "runs": runs}
    if pwal_layers and experts is not None:
        out["pwal"] = _pwal_times(experts, pwal_layers, top_k, group)
    ledger.revert_all()
    return out


def _pwal_times(experts, n: int, top_k: int, group) -> dict:
    """``n`` timed layers per mode, after one untimed layer per mode (first-call costs: lazy
    imports, the plugin's one INFO line), modes alternating; a barrier before each call, so a
    collective inside it waits only for the other ranks' same call."""
    import torch.distributed as dist

    built = {m: [_build(experts, "compressed-tensors", m, top_k, process=False)
                 for _ in range(n + 1)] for m in ("stock", "plugin")}
    times: dict = {"stock": [], "plugin": []}
    for i in range(n + 1):
        for mode in (("stock", "plugin") if i % 2 == 0 else ("plugin", "stock")):
            _switch(mode)
            runner = built[mode][i]
            routed = getattr(runner, "routed_experts", runner)
            dist.barrier(group=group)
            t0 = time.perf_counter()
            routed.quant_method.process_weights_after_loading(routed)
            if hasattr(runner, "process_weights_after_loading"):
                runner.process_weights_after_loading()
            if i:
                times[mode].append(time.perf_counter() - t0)
    a1 = {m: describe_layer(built[m][-1])["a1_gscale"] for m in built}
    return {"stock": times["stock"], "plugin": times["plugin"],
            "a1_gscale_first": {m: (v[0] if v else None) for m, v in a1.items()}}


def world_job(ctx, spec: dict) -> dict:
    """Run the parts of ``spec`` this group was asked for."""
    out = {"rank": ctx.rank, "dp_rank": ctx.dp_rank}
    if "load" in spec:
        out["load"] = load_cost(ctx, **spec["load"])
    if "forward" in spec:
        out["forward"] = forward_work(ctx, **spec["forward"])
    if "accuracy" in spec:
        out["accuracy"] = accuracy(ctx, **spec["accuracy"])
    return out
