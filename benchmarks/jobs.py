# SPDX-License-Identifier: Apache-2.0
"""Jobs that run inside simulated ranks (``simulation.layouts.spawn``); each returns plain data.

One job per layout does everything that layout's benchmarks need, because starting vLLM in a
fresh process is the expensive part: items 3 and 4 (three schemes, counted at the seam), and
on request item 2 (host overhead) and item 6 (load-time collective and check).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Iterator

import torch

from benchmarks import seam
from fp4_moe_lab.simulation import moe_layer
from fp4_moe_lab.simulation.layouts import Scenario
from vllm_fp4_moe_plugin.patches import ledger
from vllm_fp4_moe_plugin.scales import scale_agreement

SCHEMES = ("stock", "plugin", "upstream")
_index = iter(range(2000, 100000))


@contextlib.contextmanager
def _upstream_scales() -> Iterator[None]:
    """The plugin's layers, but with vLLM 0.11.1's scale policy (#26135) in every layout.

    0.11.1 sets every expert's GEMM1 input scale to the max over *all global* experts
    (v0111 modelopt.py:1488-1516), expanded to ``[E_local]``, with ``g1_alphas`` to match. In
    quantization-scale terms that is ``min gs`` over the whole EP group, which the plugin's own
    MIN all-reduce computes; prepare/finalize stay the plugin's (= #27223's passthrough in TP).
    """
    from vllm.distributed import get_ep_group

    from vllm_fp4_moe_plugin.patches.init_prepare_finalize.methods import ConsistentNvFp4MoEMixin

    def set_scales(self, layer):
        g = scale_agreement.agree_min_scale(layer.w13_input_scale_quant, get_ep_group().cpu_group)
        ws2 = layer.w13_weight_scale_2.detach().float().reshape(-1)
        layer.fp4_moe_plugin_gemm1 = scale_agreement.Gemm1ActivationScales(
            a1_gscale=g.float().expand(ws2.numel()).contiguous(),
            g1_alphas=(ws2 / g).contiguous())

    original = ConsistentNvFp4MoEMixin._fp4_set_cutlass_scales
    ConsistentNvFp4MoEMixin._fp4_set_cutlass_scales = set_scales
    try:
        yield
    finally:
        ConsistentNvFp4MoEMixin._fp4_set_cutlass_scales = original


def _build(experts, scheme: str, top_k: int):
    (ledger.revert_all if scheme == "stock" else ledger.apply_all)()
    ctx = _upstream_scales() if scheme == "upstream" else contextlib.nullcontext()
    with ctx:
        built = moe_layer.build_layer(experts, "modelopt", top_k=top_k, index=next(_index))
        moe_layer.prepare_modular_kernel(built.layer)
    return built.layer


def _inputs(scenario: Scenario, dp_rank: int, token_scale: float):
    x, logits = scenario.inputs(dp_rank)
    return (x.float() * token_scale).to(torch.bfloat16), logits


def schemes(ctx, scenario: Scenario, spreads, token_scales) -> dict:
    """Items 3+4: every scheme x spread on this rank's tokens; outputs and seam counts."""
    dp = ctx.layout.dp
    across = torch.tensor([scenario.tokens] * dp) if dp > 1 else None
    out = {"outputs": {}, "counts": {}, "a1_shape": {}}
    try:
        for spread in spreads:
            sc = Scenario(**{**scenario.__dict__, "input_scale_spread": spread})
            experts = sc.experts()
            for scheme in SCHEMES:
                layer = _build(experts, scheme, sc.top_k)
                cfg = layer.quant_method.get_fused_moe_quant_config(layer)
                out["a1_shape"][f"{spread}/{scheme}"] = list(cfg.a1_gscale.shape)
                for ts in token_scales:
                    x, logits = _inputs(sc, ctx.dp_rank, ts)
                    with seam.counting() as tally:
                        y = moe_layer.forward(layer, x, logits, vllm_config=ctx.vllm_config,
                                              num_tokens_across_dp=across)
                    key = f"{spread}/{ts}/{scheme}"
                    out["outputs"][key] = y.float()
                    out["counts"][key] = tally.as_dict()
    finally:
        ledger.revert_all()
    return out


def apply_overhead(ctx, scenario: Scenario, token_counts, calls: int) -> dict:
    """Item 2: median wall time of one ``FusedMoE.forward_impl`` (= ``quant_method.apply`` on
    a single-GPU layout) with the seam's device work replaced by shape-correct no-ops."""
    from vllm.forward_context import set_forward_context

    experts = scenario.experts()
    # a second stock layer gives an A/A ratio: the noise floor of this comparison
    layers = {s: _build(experts, s.split("#")[0], scenario.top_k)
              for s in ("stock", "plugin", "stock#2")}

    def patched_for(s):  # the direct call is looked up at call time: the plugin's needs its own
        (ledger.apply_all if s == "plugin" else ledger.revert_all)()

    g = torch.Generator().manual_seed(5)
    res: dict = {}
    with seam.host_only():
        for m in token_counts:
            x = torch.randn(m, scenario.hidden, generator=g).to(torch.bfloat16)
            logits = torch.randn(m, scenario.num_experts, generator=g).to(torch.bfloat16)
            samples = {s: [] for s in layers}
            with set_forward_context({}, ctx.vllm_config, num_tokens=m):
                passes = {}
                for s, layer in layers.items():  # warm up, and prove which path each runs
                    patched_for(s)
                    with seam.counting() as tally:
                        layer.forward_impl(x, logits)
                    passes[s] = tally.passes
                    for _ in range(3):
                        layer.forward_impl(x, logits)
                # Blocks of calls per layer, interleaved and rotating so drift hits all alike.
                # Patches change only between blocks (rebinding module globals deoptimizes
                # the callers' specialized bytecode once); 2 untimed calls after each switch.
                order = list(layers.items())
                block = max(1, min(50, calls // 4))
                for i in range(-(-calls // block)):
                    for s, layer in order[i % 3:] + order[:i % 3]:
                        patched_for(s)
                        for _ in range(2):
                            layer.forward_impl(x, logits)
                        for _ in range(block):
                            t0 = time.perf_counter()
                            layer.forward_impl(x, logits)
                            samples[s].append(time.perf_counter() - t0)
            res[m] = {s: statistics.median(v) for s, v in samples.items()}
            res[m]["pre_kernel_passes"] = passes
    ledger.revert_all()
    return res


def load_time(ctx, num_layers: int, num_experts: int) -> dict:
    """Item 6: the DP scale agreement and the load-time check, ``num_layers`` times, as each
    rank runs them in ``process_weights_after_loading`` / ``init_prepare_finalize``."""
    import torch.distributed as dist
    from vllm.distributed import get_ep_group
    from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

    from vllm_fp4_moe_plugin.patches import consistency
    from vllm_fp4_moe_plugin.patches.init_prepare_finalize.flashinfer_cutlass import (
        KernelQuantizedPrepareAndFinalize,
    )

    group = get_ep_group().cpu_group
    world = dist.get_world_size(group)
    e_local = num_experts // world
    g = torch.Generator().manual_seed(11 + ctx.rank)
    gs = [448 * 6 / (256 * (1 + 3 * torch.rand(e_local, generator=g))) for _ in range(num_layers)]
    ws2 = [1e-3 * (1 + torch.rand(e_local, generator=g)) for _ in range(num_layers)]

    dist.barrier(group=group)
    t0 = time.perf_counter()
    agreed = [scale_agreement.agree_min_scale(v, group) for v in gs]
    t_agree = time.perf_counter() - t0
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(num_layers):
        dist.barrier(group=group)
    t_barrier = time.perf_counter() - t0

    dummy = torch.zeros(e_local, 1, 1, dtype=torch.float8_e4m3fn)
    t0 = time.perf_counter()
    configs = []
    for li in range(num_layers):
        chosen = scale_agreement.shared_scalar_scales(agreed[li], ws2[li])
        configs.append(nvfp4_moe_quant_config(
            g1_alphas=chosen.g1_alphas, g2_alphas=ws2[li], a1_gscale=chosen.a1_gscale,
            a2_gscale=gs[li], w1_scale=dummy, w2_scale=dummy))
    t_config = time.perf_counter() - t0
    layers = []
    for li in range(num_layers):
        layer = torch.nn.Module()
        layer.w13_weight_scale_2 = torch.nn.Parameter(ws2[li], requires_grad=False)
        layer.layer_name = f"model.layers.{li + 3}.mlp.experts"
        layers.append(layer)
    pf = KernelQuantizedPrepareAndFinalize(use_dp=True)
    consistency.reset_for_tests()
    t0 = time.perf_counter()
    verdicts = [consistency.run_check(layers[li], configs[li], pf, None, mode="warn")
                for li in range(num_layers)]
    t_check = time.perf_counter() - t0
    return {"world": world, "e_local": e_local, "agree": t_agree, "barrier": t_barrier,
            "config": t_config, "check": t_check, "all_ok": all(v.ok for v in verdicts)}


def layout_job(ctx, spec: dict) -> dict:
    """Run the parts of ``spec`` this layout was asked for (keys: schemes, apply, load)."""
    out = {"rank": ctx.rank, "dp_rank": ctx.dp_rank}
    if "load" in spec:
        out["load"] = load_time(ctx, **spec["load"])
    if "apply" in spec:
        out["apply"] = apply_overhead(ctx, **spec["apply"])
    if "schemes" in spec:
        out["schemes"] = schemes(ctx, **spec["schemes"])
    return out
