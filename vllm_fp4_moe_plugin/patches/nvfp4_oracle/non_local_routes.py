# SPDX-License-Identifier: Apache-2.0
"""vLLM's own CUTLASS NVFP4 MoE under EP (0.32.0+): a route to another rank's expert adds zero.

Why and how: the ledger entry (``patches/nvfp4_oracle``). vLLM's route sort points every route
whose expert is not local at row ``expert_offsets[E]`` of GEMM2's output (the number of local
routes), a row GEMM2 never writes, on the promise that the output starts zeroed (csrc
moe_data.cu ``compute_arg_sorts``); ``run_cutlass_moe_fp4`` takes that output from
``workspace13``, which also holds GEMM1's output and, through vLLM's workspace manager, earlier
layers' data (v0.34.0 FM/experts/cutlass_moe.py:643-645, FM/modular_kernel.py:1266-1273).

The wrapper zeroes that one row before the call (``k`` elements, row ``min(local routes,
m * topk - 1)``: with every route local it is one GEMM2 overwrites), so each route reading it
adds exactly nothing. Where GEMM1's output can reach the row (``w1_n > k``), it also gives
those routes weight 0, and with the router weight applied on the input (top-1) zeroes the output
of a token whose route is not local. No host sync (the row index stays a device tensor: the
call captures in a CUDA graph) and no signature binding per call; without an expert map the
original is called untouched. What it adds per call, measured: ``benchmarks/route_fix.py``.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F


def local_routes(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """True where a route's (global) expert is one of this rank's; -1 ids are invalid routes
    (they index the -1 appended to the map)."""
    return F.pad(expert_map, (0, 1), value=-1)[topk_ids] >= 0


def zero_route_row(workspace13: torch.Tensor, local: torch.Tensor, k: int) -> None:
    """Zero the row of GEMM2's output (``workspace13`` as ``[m * topk, k]``) that every
    non-local route reads: ``expert_offsets[E]`` = the number of local routes."""
    routes = local.numel()
    if not workspace13.is_contiguous():  # vLLM's workspaces are; keep the contract anyway
        workspace13.zero_()
        return
    c3 = workspace13.view(-1)[: routes * k].view(routes, k)
    c3.index_fill_(0, local.sum().clamp_(max=routes - 1).reshape(1), 0)  # no host sync


def gemm1_may_write_the_row(call: dict) -> bool:
    """GEMM1's output (``[m * topk, w1_n]``, its first rows) shares ``workspace13``: it reaches
    the read row only when ``w1_n > k`` (w1_n = 2n gated, n not). DeepSeek-R1 (4096 < 7168),
    Qwen3-MoE, GLM-4.x: never; Llama-4 (16384 > 5120): yes."""
    gated = getattr(call.get("activation"), "is_gated", True) is not False
    return (2 * call["n"] if gated else call["n"]) > call["k"]


def build(original):
    """``run_cutlass_moe_fp4`` that makes non-local routes add nothing (no expert map:
    the original call)."""
    names = tuple(inspect.signature(original).parameters)  # once, not per call

    @functools.wraps(original)
    def run_cutlass_moe_fp4(*args, **kwargs):
        call = kwargs if not args else {**dict(zip(names, args)), **kwargs}
        expert_map = call.get("expert_map")
        if expert_map is None:
            return original(*args, **kwargs)
        local = local_routes(call["topk_ids"], expert_map)
        zero_route_row(call["workspace13"], local, call["k"])
        if not gemm1_may_write_the_row(call):  # the row stays zero: routes reading it add 0
            return original(**call)
        call = dict(call)  # GEMM1 may leave finite data there: give those routes weight 0
        call["topk_weights"] = call["topk_weights"] * local
        result = original(**call)
        if call.get("apply_router_weight_on_input"):  # top-1, the output not weighted
            call["output"].masked_fill_(~local, 0)
        return result

    return run_cutlass_moe_fp4
