"""vLLM 0.11.0's TRT-LLM ("latency") NVFP4 MoE backend on CPU: the seam and its matrix rows.

Seam (installed by :func:`~.blackwell.simulated_blackwell` with ``backend="latency"``); each
replacement stands in for SM100 hardware and nothing else:

=====================================================  ===========================================
FlashInfer 0.3.1 symbol replaced                       why it has to be replaced on CPU
=====================================================  ===========================================
``flashinfer.fused_moe.trtllm_fp4_block_scale_moe``    SM100-only kernel (launcher.cu:665-667) ->
                                                       ``nvfp4.trtllm_fp4_block_scale_moe``
``flashinfer.fp4_quantization.block_scale_``           picks a JIT module by the GPU's capability;
``interleave`` (``shuffle_matrix_sf_a``'s last step)   -> the CPU twin of the same 128x4 layout
``flashinfer.reorder_rows_for_gated_act_gemm``         vLLM hands it float8 views (modelopt.py:
                                                       1211-1232); CPU torch cannot index float8,
                                                       so FlashInfer's own function runs on the
                                                       same bytes viewed as uint8
``DeviceCommunicatorBase.dispatch`` / ``combine``      the CUDA communicator hands FusedMoE's naive
(vLLM)                                                 DP dispatch to its all-to-all manager
                                                       (cuda_communicator.py:97-99, 306-323); the
                                                       CPU one has none, and the base class is a
                                                       no-op. vLLM's own ``AgRsAll2AllManager``
                                                       code runs instead, over the CPU
                                                       ``all_gatherv`` / ``reduce_scatterv``
=====================================================  ===========================================

vLLM's own code runs unchanged otherwise: ``prepare_static_weight_layouts_for_trtllm_moe``
(FlashInfer's ``shuffle_matrix_a`` / ``shuffle_matrix_sf_a`` included), ``apply``'s
``fp4_quantize`` (already the emulator, see ``blackwell.py``) and its call of the kernel.

Rows: in vLLM 0.11.0 only ModelOpt takes this backend (compressed-tensors has no TRT-LLM branch,
``compressed_tensors_moe.py``), and ``apply`` always asks for DeepSeekV3 routing unless the
model is Llama 4 (``modelopt.py:1452-1456``): the kernel then reads ``e_score_correction_bias``
(null for a model without one, which the emulator refuses), so the rows use a DeepSeek-V3-style
layer -- sigmoid scores, correction bias, grouped top-k.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_fp4_moe_plugin import nvfp4

BACKEND = "flashinfer_trtllm"
#: Layouts with a TRT-LLM row. The path has no prepare/finalize of its own (``maybe_make_
#: prepare_finalize`` returns None, modelopt.py:1070-1075): DP dispatches bf16 (naive), so every
#: rank quantizes what it computes, and the all-to-all layouts do not apply.
LAYOUTS = ("single", "tp", "tp_ep", "dp")
#: The activation scale a correct layer uses: one scalar per EP rank, the min over that rank's
#: experts (what ``_fp4_set_trtllm_scales`` sets); GEMM2 stays per expert (``g1_scale_c``).
SCHEME = "shared_gemm1_per_ep_rank"
#: DeepSeek-V3-style routing of the rows: groups, groups kept (8 experts: 2 groups of 4).
NUM_EXPERT_GROUP = 2
TOPK_GROUP = 1


def _bytes_reorder(reorder):
    def call(x: torch.Tensor) -> torch.Tensor:
        return reorder(x.view(torch.uint8)).view(x.dtype)

    return call


def _agrs_manager():
    import vllm.envs as envs
    from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

    if envs.VLLM_ALL2ALL_BACKEND != "allgather_reducescatter":
        raise NotImplementedError("the CPU naive dispatch covers VLLM_ALL2ALL_BACKEND="
                                  f"allgather_reducescatter only, not {envs.VLLM_ALL2ALL_BACKEND}")
    return AgRsAll2AllManager


def _cpu_dispatch(self, hidden_states, router_logits, is_sequence_parallel=False):
    # AgRsAll2AllManager.dispatch never reads its instance (all2all.py:106-125).
    return _agrs_manager().dispatch(None, hidden_states, router_logits, is_sequence_parallel)


def _cpu_combine(self, hidden_states, is_sequence_parallel=False):
    return _agrs_manager().combine(None, hidden_states, is_sequence_parallel)


def install(patcher) -> None:
    """Add the TRT-LLM replacements to ``simulated_blackwell``'s patcher."""
    import flashinfer
    import flashinfer.fp4_quantization as fp4q
    import flashinfer.fused_moe as fused_moe
    from vllm.distributed.device_communicators.base_device_communicator import (
        DeviceCommunicatorBase)

    patcher.set(fused_moe, "trtllm_fp4_block_scale_moe", nvfp4.trtllm_fp4_block_scale_moe)
    patcher.set(fp4q, "block_scale_interleave", nvfp4.block_scale_interleave)
    patcher.set(flashinfer, "reorder_rows_for_gated_act_gemm",
                _bytes_reorder(flashinfer.reorder_rows_for_gated_act_gemm))
    patcher.set(DeviceCommunicatorBase, "dispatch", _cpu_dispatch)
    patcher.set(DeviceCommunicatorBase, "combine", _cpu_combine)


def routing_bias(scenario) -> torch.Tensor:
    """The layer's ``e_score_correction_bias`` (fp32, as DeepSeek-V3 declares it,
    deepseek_v2.py:164-166), deterministic in the scenario's seed."""
    g = torch.Generator().manual_seed(scenario.seed * 1000 + 901)
    return torch.randn(scenario.num_experts, generator=g) * 0.1


def layer_kwargs(scenario) -> dict:
    return dict(use_grouped_topk=True, num_expert_group=NUM_EXPERT_GROUP, topk_group=TOPK_GROUP,
                scoring_func="sigmoid", e_score_correction_bias=routing_bias(scenario))


def trtllm_outputs(ctx, scenario, modes=("stock", "plugin")):
    """Job (runs in every rank of a layout): the ModelOpt layer on the TRT-LLM backend, stock and
    with the plugin, on the scenario's tokens."""
    from vllm_fp4_moe_plugin import patches
    from vllm_fp4_moe_plugin.simulation import moe_layer
    from vllm_fp4_moe_plugin.simulation.blackwell import simulated_blackwell
    from vllm_fp4_moe_plugin.simulation.layouts import RankOutput, describe_layer

    result = RankOutput(rank=ctx.rank, dp_rank=ctx.dp_rank)
    experts = scenario.experts()
    x, logits = scenario.inputs(ctx.dp_rank)
    dp = ctx.layout.dp
    across_dp = torch.tensor([scenario.tokens] * dp) if dp > 1 else None
    try:
        with simulated_blackwell(backend="latency"):
            for index, mode in enumerate(modes):
                if mode == "plugin":
                    patches.apply_all()
                else:
                    patches.revert_all()
                built = moe_layer.build_layer(experts, "modelopt", top_k=scenario.top_k,
                                              index=index, **layer_kwargs(scenario))
                moe_layer.prepare_modular_kernel(built.layer)
                key = f"modelopt/{mode}"
                try:
                    out = moe_layer.forward(built.layer, x, logits, vllm_config=ctx.vllm_config,
                                            num_tokens_across_dp=across_dp)
                except Exception as exc:  # a layout stock cannot run at all is a row too
                    result.errors[key] = f"{type(exc).__name__}: {exc}"
                    out = None
                result.info[key] = describe_layer(built.layer)
                result.info[key]["backend"] = str(built.layer.quant_method.flashinfer_moe_backend)
                if out is not None:
                    result.outputs[key] = out.float()
    finally:
        patches.revert_all()
    return result


def references(scenario, dp_rank: int, ep_size: int):
    """(ideal NVFP4 reference, fp32 reference) for one rank's tokens: the kernel's own routing
    (``nvfp4.trtllm_emulator.route``: DeepSeekV3, bf16 weights), GEMM1 activations quantized
    with the min scale of each expert's EP rank, GEMM2's per expert; all fp32 (the TRT-LLM
    kernel stores only GEMM2's output in bf16, see ``trtllm_emulator.py``)."""
    from vllm_fp4_moe_plugin.nvfp4.trtllm_emulator import route

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
    fp32 = nvfp4.moe_reference_fp32(x, experts, w, ids)
    return ideal, fp32


def run_layout(layout_name: str, scenario) -> list:
    """Every rank's :func:`trtllm_outputs` in ``layout_name`` (real spawned gloo groups)."""
    from vllm_fp4_moe_plugin.simulation.layouts import LAYOUTS as ALL, spawn

    return spawn(ALL[layout_name], f"{__name__}:trtllm_outputs", scenario)


def rows_for_layout(layout_name: str, scenario, ranks=None) -> list:
    """The ModelOpt TRT-LLM row of one layout, judged like the CUTLASS rows (matrix.py);
    ``ranks``: outputs of :func:`run_layout` already in hand."""
    from vllm_fp4_moe_plugin.simulation import matrix
    from vllm_fp4_moe_plugin.simulation.layouts import LAYOUTS as ALL

    layout = ALL[layout_name]
    version, design = matrix.installed_release()
    ranks = ranks if ranks is not None else run_layout(layout_name, scenario)
    ep_size = layout.tp * layout.dp if layout.ep else 1
    refs: dict[int, Any] = {}
    errs: dict[str, list] = {"stock": [], "plugin": []}
    fp32_errs: dict[str, list] = {"stock": [], "plugin": []}
    failures: dict[str, Any] = {"stock": None, "plugin": None}
    noise = []
    for r in ranks:
        if r.dp_rank not in refs:
            refs[r.dp_rank] = references(scenario, r.dp_rank, ep_size)
        ideal, fp32 = refs[r.dp_rank]
        noise.append(matrix.rel_err(ideal, fp32))
        for mode in errs:
            out = r.outputs.get(f"modelopt/{mode}")
            if out is None:
                errs[mode].append(float("inf"))
                fp32_errs[mode].append(float("inf"))
                failures[mode] = failures[mode] or r.errors[f"modelopt/{mode}"]
                continue
            errs[mode].append(matrix.rel_err(out, ideal))
            fp32_errs[mode].append(matrix.rel_err(out, fp32))
    stock, plugin, floor = max(errs["stock"]), max(errs["plugin"]), max(noise)
    plugin_fp32 = max(fp32_errs["plugin"])
    affected = stock >= matrix.AFFECTED_FACTOR * matrix.PLUGIN_BOUND
    identical = not any(failures.values()) and all(
        torch.equal(r.outputs["modelopt/stock"], r.outputs["modelopt/plugin"]) for r in ranks)
    correct = plugin <= matrix.PLUGIN_BOUND and plugin_fp32 <= matrix.FP32_FACTOR * floor
    info = ranks[0].info["modelopt/plugin"]
    return [matrix.Row(
        format="modelopt", layout=layout_name, backend=BACKEND,
        stock_rel_err=stock, plugin_rel_err=plugin, bound=matrix.PLUGIN_BOUND,
        noise_floor=floor, plugin_fp32_err=plugin_fp32, stock_fp32_err=max(fp32_errs["stock"]),
        stock_affected=affected, bit_identical=identical, reference_scheme=SCHEME,
        vllm_version=version, design=design, stock_error=failures["stock"],
        plugin_error=failures["plugin"], ok=correct and (affected or identical),
        plugin_prepare_finalize=info["prepare_finalize"],
        plugin_a1_gscale_shape=info["a1_gscale_shape"],
        plugin_check=[None for _ in ranks])]


def applies(layout_name: str, formats, design) -> bool:
    """Whether the matrix gets a TRT-LLM row: vLLM 0.11.0's design, ModelOpt, a listed layout."""
    from vllm_fp4_moe_plugin.support import Design

    return design is Design.INIT_PREPARE_FINALIZE and "modelopt" in formats and layout_name in LAYOUTS
