# SPDX-License-Identifier: Apache-2.0
"""What the router-weight patch adds to every MoE layer call, on the GPU and the host.

Why: ``patches/router_weight_once.py`` wraps the modular kernel's experts call, which every
NVFP4 (and every other modular) MoE layer runs on every forward: a model without the on-input
flag pays a flag lookup, a Llama-4 layer one ``ones_like`` of its ``[m, 1]`` router weights. On
vLLM 0.11.0-0.12.0 it also wraps ``FusedMoE.forward_impl_chunked`` (the DP-chunked forward):
every layer pays a flag lookup, an NVFP4 Llama-4 layer a ``functools.partial`` of its quant
method's ``apply`` and its removal. Both are timed around calls that do nothing, so only what
the patch adds is measured, at Llama-4 Maverick's shape (hidden 5120, top-1, 128 experts,
24 MoE layers) for m tokens on the rank (decode 1-256, prefill 2048-8192): eagerly, and replayed
from a CUDA graph (``--graph``: vLLM's decode), where the Python does not run at all and what
is left is the ``ones_like`` kernel captured in the graph.

    python -m benchmarks.router_weight --device cuda --graph --json router_weight.json
"""

from __future__ import annotations

import functools
import json
from types import SimpleNamespace

import torch

from benchmarks.route_fix import _time, save_json, timing_parser
from vllm_fp4_moe_plugin.patches import router_weight_once as rw

MAVERICK = {"hidden": 5120, "topk": 1, "experts": 128, "moe_layers": 24}
TOKENS = (1, 32, 256, 2048, 8192)


class WeightingPrepare:
    """A prepare/finalize whose prepare scales its input by the router weight, as every vLLM
    prepare but the passthrough one does (``prepare_applies_weight`` reads it from the source)."""

    def prepare(self, a1, topk_weights):
        return a1 * topk_weights


def experts_call_stub(self, in_dtype, a1q, a1q_scale, w1, w2, topk_weights, topk_ids,
                      activation, global_num_experts, local_num_experts, expert_map,
                      apply_router_weight_on_input, expert_tokens_meta, output_alias=None):
    """vLLM 0.34.0's ``_fused_experts`` signature (FM/modular_kernel.py:1383-1399), doing
    nothing: the experts' GEMMs are stock's either way."""


def chunked_stub(self, full_hidden_states, full_router_logits):
    """``FusedMoE.forward_impl_chunked``'s signature (v0120 fused_moe/layer.py), doing
    nothing."""


class KernelStub(torch.nn.Module):
    """``FusedMoEModularKernel`` with a shared expert that does nothing: what the shared-expert
    entry adds (a copy of the input on Llama-4 layers) is all that is timed."""

    def __init__(self):
        super().__init__()
        self.shared_experts = torch.nn.Identity()
        self.fused_experts = SimpleNamespace(quant_config=SimpleNamespace(quant_dtype="nvfp4"))

    def forward(self, hidden_states, w1=None, w2=None, topk_weights=None, topk_ids=None,
                inplace=False, activation="silu", global_num_experts=-1, expert_map=None,
                apply_router_weight_on_input=False):
        return self.shared_experts(hidden_states)


def make_call(m: int, device: str, on_input: bool, shape=MAVERICK) -> dict:
    g = torch.Generator(device="cpu").manual_seed(m)
    return dict(in_dtype=torch.bfloat16,
                a1q=torch.empty(m, shape["hidden"], dtype=torch.bfloat16, device=device),
                a1q_scale=None, w1=None, w2=None,
                topk_weights=torch.rand(m, shape["topk"], generator=g).to(device),
                topk_ids=torch.randint(shape["experts"], (m, shape["topk"]), generator=g,
                                       dtype=torch.int32).to(device),
                activation=None, global_num_experts=shape["experts"],
                local_num_experts=shape["experts"], expert_map=None,
                apply_router_weight_on_input=on_input, expert_tokens_meta=None)


def kernel() -> SimpleNamespace:
    return SimpleNamespace(prepare_finalize=WeightingPrepare(), fused_experts=SimpleNamespace(
        quant_config=SimpleNamespace(quant_dtype="nvfp4")))


def layer(on_input: bool) -> SimpleNamespace:
    """A FusedMoE stand-in: the on-input flag, an NVFP4 marker, a quant method with ``apply``."""
    method = SimpleNamespace()
    method.apply = lambda *a, **k: None
    return SimpleNamespace(apply_router_weight_on_input=on_input, quant_method=method,
                           **{rw.vm.NVFP4_MOE_MARKERS[0]: None})


def measure(device: str, tokens=TOKENS, *, graph: bool = False, repeat: int = 50) -> list[dict]:
    rows = []
    wrapped = rw.build(experts_call_stub)
    k = kernel()
    for m in tokens:
        for on_input in (False, True):
            call = make_call(m, device, on_input)
            modes = ("eager", "graph") if graph and device == "cuda" else ("eager",)
            for mode in modes:
                row = {"tokens": m, "device": device, "mode": mode, "on_input": on_input,
                       "site": "experts_call"}
                row["stock_us"] = _time(functools.partial(experts_call_stub, k), call,
                                        device=device, repeat=repeat, graph=mode == "graph")
                row["patched_us"] = _time(functools.partial(wrapped, k), call, device=device,
                                          repeat=repeat, graph=mode == "graph")
                row["added_us"] = row["patched_us"] - row["stock_us"]
                row["added_per_step_ms"] = row["added_us"] * MAVERICK["moe_layers"] / 1e3
                rows.append(row)
    shared_forward = rw.build_shared_input(KernelStub.forward)
    for m in tokens:  # the shared-expert entry on FusedMoEModularKernel.forward (0.11.x-0.12.x)
        for on_input in (False, True):
            kern = KernelStub()
            call = {"hidden_states": torch.empty(m, MAVERICK["hidden"], dtype=torch.bfloat16,
                                                 device=device),
                    "apply_router_weight_on_input": on_input}
            for mode in (("eager", "graph") if graph and device == "cuda" else ("eager",)):
                row = {"tokens": m, "device": device, "mode": mode, "on_input": on_input,
                       "site": "kernel_forward"}
                row["stock_us"] = _time(functools.partial(KernelStub.forward, kern), call,
                                        device=device, repeat=repeat, graph=mode == "graph")
                row["patched_us"] = _time(functools.partial(shared_forward, kern), call,
                                          device=device, repeat=repeat, graph=mode == "graph")
                row["added_us"] = row["patched_us"] - row["stock_us"]
                row["added_per_step_ms"] = row["added_us"] * MAVERICK["moe_layers"] / 1e3
                rows.append(row)
    chunked = rw.build_chunked(chunked_stub)
    for on_input in (False, True):  # host only: vLLM never captures the chunked forward
        lay = layer(on_input)
        call = {"full_hidden_states": None, "full_router_logits": None}
        row = {"tokens": None, "device": device, "mode": "eager", "on_input": on_input,
               "site": "forward_impl_chunked"}
        row["stock_us"] = _time(functools.partial(chunked_stub, lay), call, device="cpu",
                                repeat=repeat * 20, graph=False)
        row["patched_us"] = _time(functools.partial(chunked, lay), call, device="cpu",
                                  repeat=repeat * 20, graph=False)
        row["added_us"] = row["patched_us"] - row["stock_us"]
        row["added_per_step_ms"] = row["added_us"] * MAVERICK["moe_layers"] / 1e3
        rows.append(row)
    return rows


def main(argv=None) -> int:
    args = timing_parser(__doc__, TOKENS).parse_args(argv)
    rows = measure(args.device, args.tokens, graph=args.graph, repeat=args.repeat)
    for r in rows:
        print(json.dumps(r))
    if args.json:
        save_json(args.json, MAVERICK, args.device, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
