# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.11.0's TRT-LLM ("latency") rows of the matrix: the rank job, the references, the rows.

In vLLM 0.11.0 only ModelOpt takes this backend, with DeepSeek-V3 routing (the seam and why:
:mod:`.trtllm_seam`). Each row is judged by the same rule as the CUTLASS rows (:mod:`.judge`).
"""

from __future__ import annotations

from typing import Any

import torch

from fp4_moe_lab import nvfp4
from fp4_moe_lab.nvfp4.trtllm_emulator import route
from fp4_moe_lab.simulation.judge import carried_split, installed_release, judge
from fp4_moe_lab.simulation.trtllm_seam import (
    NUM_EXPERT_GROUP,
    TOPK_GROUP,
    layer_kwargs,
    routing_bias,
)
from vllm_fp4_moe_plugin.base.support import Design

BACKEND = "flashinfer_trtllm"
#: Layouts with a TRT-LLM row. The path has no prepare/finalize of its own (``maybe_make_
#: prepare_finalize`` returns None, modelopt.py:1070-1075): DP dispatches bf16 (naive), so every
#: rank quantizes what it computes, and the all-to-all layouts do not apply.
LAYOUTS = ("single", "tp", "tp_ep", "dp")
#: The activation scale a correct layer uses: one scalar per EP rank, the min over that rank's
#: experts (what ``_fp4_set_trtllm_scales`` sets); GEMM2 stays per expert (``g1_scale_c``).
SCHEME = "shared_gemm1_per_ep_rank"


def trtllm_outputs(ctx, scenario, modes=("stock", "plugin")):
    """Job (runs in every rank of a layout): the ModelOpt layer on the TRT-LLM backend, stock and
    with the plugin, on the scenario's tokens (the CUTLASS job, inside the latency seam)."""
    from fp4_moe_lab.simulation.blackwell import simulated_blackwell
    from fp4_moe_lab.simulation.layouts import stock_and_plugin_outputs

    with simulated_blackwell(backend="latency"):
        return stock_and_plugin_outputs(ctx, scenario, ("modelopt",), modes,
                                        layer_kwargs=layer_kwargs(scenario))


def references(scenario, dp_rank: int, ep_size: int):
    """(ideal NVFP4 reference, fp32 reference) for one rank's tokens: the kernel's own routing
    (``nvfp4.trtllm_emulator.route``: DeepSeekV3, bf16 weights), GEMM1 activations quantized
    with the min scale of each expert's EP rank, GEMM2's per expert; all fp32 (the TRT-LLM
    kernel stores only GEMM2's output in bf16, see ``trtllm_emulator.py``)."""
    experts = scenario.experts()
    x, logits = scenario.inputs(dp_rank)
    # vLLM 0.11.0 hands the kernel fp32 logits and a bf16 bias (modelopt.py:1457-1463).
    ids, weights = route(logits.float(), routing_bias(scenario).to(torch.bfloat16),
                         routing_method_type=2, top_k=scenario.top_k, n_group=NUM_EXPERT_GROUP,
                         topk_group=TOPK_GROUP, routed_scaling_factor=None)
    gs = experts.w13_input_gs.float()
    a1 = gs.reshape(ep_size, -1).amin(dim=1, keepdim=True).expand(ep_size,
                                                                   gs.numel() // ep_size)
    w = weights.float()
    ideal = nvfp4.moe_reference_nvfp4(x, experts, w, ids, a1_gs=a1.reshape(-1).contiguous())
    return scenario.with_shared(x, ideal, nvfp4.moe_reference_fp32(x, experts, w, ids))


def run_layout(layout_name: str, scenario) -> list:
    """Every rank's :func:`trtllm_outputs` in ``layout_name`` (real spawned gloo groups)."""
    from fp4_moe_lab.simulation.layouts import LAYOUTS as ALL
    from fp4_moe_lab.simulation.layouts import spawn

    return spawn(ALL[layout_name], f"{__name__}:trtllm_outputs", scenario)


def rows_for_layout(layout_name: str, scenario, ranks=None) -> list:
    """The ModelOpt TRT-LLM row of one layout, judged like the CUTLASS rows (:mod:`.judge`);
    ``ranks``: outputs of :func:`run_layout` already in hand."""
    from fp4_moe_lab.simulation.layouts import LAYOUTS as ALL

    layout = ALL[layout_name]
    ranks = ranks if ranks is not None else run_layout(layout_name, scenario)
    refs: dict[int, Any] = {}

    def rank_refs(r):
        if r.dp_rank not in refs:
            refs[r.dp_rank] = references(scenario, r.dp_rank, layout.ep_size)
        return refs[r.dp_rank]

    release = installed_release()
    carried = carried_split(scenario.gate_up_split, release[1], "modelopt", BACKEND)
    return [judge("modelopt", layout_name, BACKEND, ranks, rank_refs, scheme=SCHEME,
                  release=release, carried=carried)]


def applies(layout_name: str, formats, design) -> bool:
    """Whether the matrix gets a TRT-LLM row: vLLM 0.11.0's design, ModelOpt, a listed layout."""
    return (design is Design.INIT_PREPARE_FINALIZE and "modelopt" in formats
            and layout_name in LAYOUTS)
