# SPDX-License-Identifier: Apache-2.0
"""vLLM's own CUTLASS NVFP4 MoE under EP (0.32.0+): a route to another rank's expert adds zero.

Why and how: the ledger entry (``patches/nvfp4_oracle``). vLLM's route sort points every route
whose expert is not local at row ``expert_offsets[E]`` of GEMM2's output, a row GEMM2 never
writes, on the promise that the output starts zeroed (csrc moe_data.cu ``compute_arg_sorts``);
``run_cutlass_moe_fp4`` takes that output from ``workspace13``, which also held GEMM1's output
and, through vLLM's workspace manager, earlier layers' data (v0.34.0 FM/experts/cutlass_moe.py:
643-645, FM/modular_kernel.py:1266-1273). The wrapper keeps that row finite and gives the routes
that read it weight zero, so each adds exactly nothing: the region of ``workspace13`` GEMM2's
output covers is zeroed first (what vLLM's FP8 path did for the same contract, #20167), and with
the router weight applied on the input (top-1) a token whose route is not local gets zero.
"""

from __future__ import annotations

import functools
import inspect

import torch


def local_routes(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """True where a route's (global) expert is one of this rank's; -1 ids are invalid routes."""
    return (topk_ids >= 0) & (expert_map[topk_ids.clamp(min=0).long()] >= 0)


def build(original):
    """``run_cutlass_moe_fp4`` that zeroes what non-local routes read (none: unchanged)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def run_cutlass_moe_fp4(*args, **kwargs):
        call = signature.bind(*args, **kwargs).arguments if args else kwargs
        expert_map = call.get("expert_map")
        if expert_map is None:
            return original(*args, **kwargs)
        call = dict(call)
        topk_ids, weights = call["topk_ids"], call["topk_weights"]
        local = local_routes(topk_ids, expert_map)
        call["topk_weights"] = torch.where(local, weights, torch.zeros((), dtype=weights.dtype,
                                                                       device=weights.device))
        workspace = call["workspace13"]
        rows = call["m"] * topk_ids.size(1) * call["k"]  # GEMM2's output: [m * topk, k]
        (workspace.view(-1)[:rows] if workspace.is_contiguous() else workspace).zero_()
        result = original(**call)
        if call.get("apply_router_weight_on_input"):  # top-1, the output not weighted
            call["output"].masked_fill_(~local.any(dim=1, keepdim=True), 0)
        return result

    return run_cutlass_moe_fp4
