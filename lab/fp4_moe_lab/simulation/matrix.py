# SPDX-License-Identifier: Apache-2.0
"""The consistency matrix: every format x layout x backend, stock vs plugin, on the same inputs.

Each row compares the real vLLM layer output of the installed release (a Blackwell GPU simulated,
SM100 unless a ``capability`` is asked for; FlashInfer emulated) with two plain loop-over-experts
references computed here from the same seeds:

* the fp32 reference: dequantized weights, unquantized activations;
* the ideal NVFP4 reference *for that layout and release*: activations quantized per expert
  inside the kernel, or with the one shared scalar ``min_e gs_e`` over all experts (DP layouts;
  and every ModelOpt layout from 0.11.1, whose #26135 collapses the scales in all layouts).

How a row is judged against them (the bound, the noise floor, the ``ok`` rule) is
:mod:`.judge`'s, the same for every backend.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Optional

import torch

from fp4_moe_lab.simulation import gpus, trtllm_rows
from fp4_moe_lab.simulation.judge import Row, carried_split, installed_release, judge
from fp4_moe_lab.simulation.layouts import LAYOUTS, Scenario, run_layout
from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.support import Design

BACKEND = "flashinfer_cutlass"


def _min_per_rank(gs: torch.Tensor, ep_size: int) -> torch.Tensor:
    """Each expert's entry replaced by the min over the experts of its EP rank (vLLM's linear
    placement: rank r owns the r-th contiguous block of E / ep_size experts)."""
    blocks = gs.reshape(ep_size, -1)
    return blocks.min(dim=1, keepdim=True).values.expand_as(blocks).reshape(-1)


def references(scenario: Scenario, dp_rank: int, scheme: str, ep_size: int = 1,
               intermediate_dtype: Optional[torch.dtype] = torch.bfloat16,
               kernel_routing: bool = False):
    """(ideal NVFP4 reference, fp32 reference) for one rank's tokens, under ``scheme``
    (see :func:`reference_scheme`); ``ep_size`` groups the experts for the per-rank schemes.
    ``intermediate_dtype``: where the kernel rounds GEMM1's output (CUTLASS: bf16; the TRT-LLM
    kernel requantizes it straight from fp32, ``None``, see ``trtllm_emulator.py``).
    ``kernel_routing``: the DeepSeek-V3-style layer routed by the TRT-LLM monolithic kernel
    itself (:func:`trtllm_kernel_routing`) instead of the layer's softmax top-k."""
    from fp4_moe_lab.nvfp4 import moe_reference_fp32, moe_reference_nvfp4
    from fp4_moe_lab.simulation.blackwell import cpu_topk_softmax_routing

    experts = scenario.experts(ep_size)
    x, logits = scenario.inputs(dp_rank)
    x_in = x
    if kernel_routing:
        weights, ids = trtllm_kernel_routing(scenario, logits)
    elif scenario.router_weight_on_input:  # what the layer is asked to compute (Llama-4):
        from fp4_moe_lab.simulation.layouts import llama4_routing

        weights, ids = llama4_routing()(x, logits, scenario.top_k, False)
        x = x * weights.to(x.dtype)  # the input scaled before quantization, once
        weights = torch.ones_like(weights)
    else:
        weights, ids = cpu_topk_softmax_routing(x, logits, scenario.top_k, True)
    gs = experts.w13_input_gs.float()
    if scheme not in SCHEMES:
        raise ValueError(f"unknown reference scheme {scheme!r}")
    g2 = experts.w2_input_gs.float()
    if scheme == "per_expert":
        a1 = gs
    elif scheme == "rank_gemm1_gemm2":
        a1 = _min_per_rank(gs, ep_size)
    else:
        a1 = gs.min().reshape(())
    if scheme == "shared_gemm1_gemm2":
        a2 = g2.min().expand_as(g2)
    elif scheme in ("shared_gemm1_rank_gemm2", "rank_gemm1_gemm2"):
        a2 = _min_per_rank(g2, ep_size)
    else:
        a2 = None
    # bf16 where the kernel stores GEMM outputs and the SwiGLU result (fused_moe_emulator.py).
    ideal = moe_reference_nvfp4(x, experts, weights, ids, a1_gs=a1, a2_gs=a2,
                                intermediate_dtype=intermediate_dtype)
    return scenario.with_shared(x_in, ideal, moe_reference_fp32(x, experts, weights, ids))


def trtllm_kernel_routing(scenario: Scenario, logits: torch.Tensor):
    """(weights, ids) the TRT-LLM monolithic kernel computes for the DeepSeek-V3-style layer
    (``trtllm_seam.layer_kwargs``: sigmoid, correction bias, 2 groups keep 1): vLLM 0.34.0
    hands it the router logits, ``e_score_correction_bias`` and ``routing_method_type``
    DeepSeekV3 (FM/experts/trtllm_nvfp4_moe.py:601-633); the emulator's own routing (0.7
    contract), bf16 weights as the routing kernel writes them."""
    from fp4_moe_lab.nvfp4.trtllm_emulator import RoutingMethodType, route
    from fp4_moe_lab.simulation import trtllm_seam

    ids, weights = route(logits, trtllm_seam.routing_bias(scenario),
                         routing_method_type=int(RoutingMethodType.DeepSeekV3),
                         top_k=scenario.top_k, n_group=trtllm_seam.NUM_EXPERT_GROUP,
                         topk_group=trtllm_seam.TOPK_GROUP, routed_scaling_factor=1.0,
                         contract="0.7")
    return weights.float(), ids.long()


# per_expert: each expert's own GEMM1 input scale (kernel-side quantization);
# shared_gemm1: one GEMM1 scale, the min of gs over all experts (DP dispatch);
# shared_gemm1_gemm2: that, and GEMM2's scale collapsed the same way (ModelOpt from 0.11.1,
#   #26135: w13_input_scale.max() and w2_input_scale.max() in every layout, v0111 MO:1488-1525).
# shared_gemm1_rank_gemm2: one GEMM1 scale over all experts, GEMM2's collapsed per EP rank;
# rank_gemm1_gemm2: both collapsed over each EP rank's local experts (the oracle design, below).
SCHEMES = ("per_expert", "shared_gemm1", "shared_gemm1_gemm2", "shared_gemm1_rank_gemm2",
           "rank_gemm1_gemm2")


def _oracle_reference_scheme(fmt: str, layout) -> str:
    """The NVFP4-oracle design (vLLM 0.14.0+, read on v0.34.0; Q = model_executor/layers/
    quantization), with FLASHINFER_CUTLASS, i.e. a global-sf backend (oracle/nvfp4.py:69-83).

    Every such backend collapses each scale to one value per rank:
    ``amax_for_moe_activation_quant(a_scale, enable_eplb)`` = the max over the scales the rank
    holds, all-reduced only with EPLB (Q/utils/flashinfer_fp4_moe.py:495-504,
    Q/utils/quant_utils.py:77-97). ModelOpt holds every expert's input scale on every rank
    (Q/modelopt.py:1041-1058; loader FM/routed_experts.py:764-771, 845-879), so both GEMMs use
    the max over ALL experts (= min input global scale) everywhere. Compressed-tensors holds
    only the
    rank's local experts' scales (compressed_tensors_moe_w4a4_nvfp4.py:189-208, 242), so its
    collapse is over the local experts: everything when there is no EP (single, pp, tp,
    tp_all2allv, dp); per EP rank with EP. GEMM2 is quantized and dequantized on the expert's
    rank, so a per-rank GEMM2 scale is consistent. GEMM1 is consistent per rank as long as the
    rank that quantizes is the one that owns the expert: true in tp_ep (replicated tokens, each
    rank quantizes its own copy, prepare_finalize/no_dp_ep.py), false under DP+EP, where the
    sender quantizes before dispatch (naive_dp_ep.py:26-54, flashinfer_nvlink_two_sided.py:
    150-173, flashinfer_nvlink_one_sided.py:126-147): there a correct layer needs one GEMM1
    scale on every rank, the max over ALL experts (what ModelOpt has, and what the plugin's
    EP-group MAX all-reduce gives). Where compressed-tensors too loads every expert's input
    scales (upstream/0001 applied: the plugin's probe reads it), it collapses as ModelOpt does."""
    if fmt == "modelopt" or layout.ep_size == 1 or _ct_loads_every_experts_input_scales():
        return "shared_gemm1_gemm2"
    if layout.dispatches_quantized:
        return "shared_gemm1_rank_gemm2"
    return "rank_gemm1_gemm2"


@functools.cache  # read from vLLM's source; asked once per row
def _ct_loads_every_experts_input_scales() -> bool:
    from vllm_fp4_moe_plugin.patches.nvfp4_oracle import probe

    return probe.ct_loads_every_experts_input_scales()


def reference_scheme(design: Optional[Design], fmt: str, layout,
                     oracle: Optional[bool] = None, kernel: str = BACKEND) -> str:
    """Which activation scales a *correct* layer uses on this release and layout.
    ``oracle``: the installed vLLM has the NVFP4-oracle design (default: probe it);
    ``kernel``: the NVFP4 MoE kernel the rows run (``support._BACKEND_KERNELS`` names).
    vLLM's own CUTLASS (:data:`VLLM_CUTLASS`) is no global-sf backend (oracle/nvfp4.py:69-83):
    it keeps one GEMM1 scale per local expert (the max over w1/w3) and GEMM2's per local
    expert (Q/utils/flashinfer_fp4_moe.py:496-506), and quantizes after dispatch, per expert
    (FM/experts/cutlass_moe.py:636-676, ``expects_unquantized_inputs`` :719-721): every layout
    is ``per_expert`` there."""
    if oracle is None:
        from fp4_moe_lab.simulation import blackwell_oracle

        oracle = blackwell_oracle.applies()
    if oracle and kernel == VLLM_CUTLASS:
        return "per_expert"
    if oracle:
        return _oracle_reference_scheme(fmt, layout)
    if design is Design.MODULAR_METHOD and fmt == "modelopt":
        return "shared_gemm1_gemm2"
    if layout.dispatches_quantized:
        return "shared_gemm1"
    return "per_expert"


def trtllm_routes_itself(backend: str, layout) -> bool:
    """Which TRT-LLM rows use the monolithic, self-routing kernel: vLLM 0.34.0 takes
    ``TrtLlmNvFp4ExpertsMonolithic`` unless all-to-all kernels are in use (DP+EP) or EPLB is on
    (FM/experts/trtllm_nvfp4_moe.py:518-524), and only for a routing method the kernel knows
    (:526-541; a custom routing function is not one). Those rows use a DeepSeek-V3-style layer
    (grouped top-k with correction bias) routed by the kernel; the DP+EP rows keep the layer's
    softmax top-k and the modular experts (``trtllm_fp4_block_scale_routed_moe``)."""
    return backend == "flashinfer_trtllm" and not (layout.dp > 1 and layout.ep)


def trtllm_layer_kwargs(scenario: Scenario) -> dict:
    """The DeepSeek-V3-style layer of the self-routing TRT-LLM rows, vLLM's own router."""
    from fp4_moe_lab.simulation import trtllm_seam

    return dict(trtllm_seam.layer_kwargs(scenario), custom_routing_function=None)


#: ``--moe-backend auto``: vLLM's oracle picks (oracle design, KernelConfig.moe_backend)
AUTO = "auto"
#: ``--moe-backend cutlass``: vLLM's own CUTLASS NVFP4 MoE kernel (``CutlassExpertsFp4``), the
#: per-expert-scale backend; asked for by name only, never in :func:`default_backends`
VLLM_CUTLASS = "vllm_cutlass"
#: matrix backend -> the oracle seam's backend (blackwell_oracle.MOE_BACKENDS).
ORACLE_SEAM_BACKENDS = {BACKEND: "throughput", "flashinfer_trtllm": "latency", AUTO: "auto",
                        VLLM_CUTLASS: "vllm_cutlass"}


def auto_pick(capability: str) -> str:
    """The backend ``--moe-backend auto`` runs on this GPU by the support model
    (``support.nvfp4_moe_kernel``): the auto rows are set up for it, and each of their ranks
    checks that vLLM's oracle picked it."""
    from vllm_fp4_moe_plugin.base import support

    picked, why = support.nvfp4_moe_kernel(installed_release()[1], capability, None,
                                           moe_backend=AUTO)
    if picked not in ORACLE_SEAM_BACKENDS:
        raise NotImplementedError(f"--moe-backend auto on {capability}: {why}")
    return picked


def _not_the_pick(ranks, formats, picked: str) -> None:
    """A rank where vLLM's oracle chose another backend than the support model's: that mode's
    output is set aside and the row fails with what vLLM chose."""
    for r in ranks:
        for key, info in r.info.items():
            chosen = str(info.get("backend")).lower()
            if key.partition("/")[0] in formats and chosen != picked and key in r.outputs:
                del r.outputs[key]
                r.errors[key] = (f"--moe-backend auto: vLLM chose {chosen}, the support model "
                                 f"says {picked}")


def rows_for_layout(layout_name: str, scenario: Scenario,
                    formats=("modelopt", "compressed-tensors"), backend: str = BACKEND,
                    ranks=None, capability: str = gpus.DEFAULT_CAPABILITY) -> list[Row]:
    """One row per format. ``backend`` ``"flashinfer_trtllm"`` (oracle design only): vLLM's
    oracle picks FLASHINFER_TRTLLM (``--moe-backend flashinfer_trtllm``): the monolithic,
    self-routing kernel on a DeepSeek-V3-style layer where vLLM takes it, the modular experts
    and ``trtllm_fp4_block_scale_routed_moe`` under DP+EP (:func:`trtllm_routes_itself`); the
    scales are collapsed exactly as for
    CUTLASS (both are global-sf backends, oracle/nvfp4.py:69-83), so the reference scheme is
    the same, without CUTLASS's bf16 rounding of GEMM1's output. ``ranks``: outputs of
    :func:`~.layouts.run_layout` for this layout and backend already in hand; ``capability``:
    the GPU the seam reports (``gpus.CAPABILITIES``). ``backend`` :data:`AUTO`: vLLM picks
    (``--moe-backend auto``); the row is set up for :func:`auto_pick`'s backend and labelled
    ``"auto: <it>"``, and fails where vLLM picked another. The references do not depend
    on it: the scale collapse is vLLM's Python, the same on every family (module docstring of
    :mod:`.blackwell_oracle`, GPU families); a backend vLLM refuses there is a refused row."""
    layout = LAYOUTS[layout_name]
    version, design = installed_release()
    picked = auto_pick(capability) if backend == AUTO else backend
    kernel_routing = trtllm_routes_itself(picked, layout)
    if picked == trtllm_rows.BACKEND:
        from fp4_moe_lab.simulation.oracle_trtllm import accepted_hidden

        scenario = dataclasses.replace(scenario, hidden=accepted_hidden(scenario.hidden))
    if ranks is None:
        ranks = run_layout(layout, scenario, formats=formats,
                           backend=ORACLE_SEAM_BACKENDS[backend],
                           layer_kwargs=trtllm_layer_kwargs(scenario) if kernel_routing else None,
                           capability=capability)
    if backend == AUTO:
        _not_the_pick(ranks, formats, picked)
    # bf16 GEMM outputs and SwiGLU result: FlashInfer's CUTLASS, and vLLM's own (c1/c3 are
    # workspaces of the activation dtype, FM/experts/cutlass_moe.py:643-645, 774-775; the
    # fused SiLU+Mul quantizer rounds silu(gate)*up to it, oracle_vllm_cutlass)
    inter_dtype = torch.bfloat16 if picked in (BACKEND, VLLM_CUTLASS) else None
    refs: dict = {}

    def refs_for(scheme):
        def rank_refs(r):
            if (r.dp_rank, scheme) not in refs:
                refs[r.dp_rank, scheme] = references(scenario, r.dp_rank, scheme,
                                                     ep_size=layout.ep_size,
                                                     intermediate_dtype=inter_dtype,
                                                     kernel_routing=kernel_routing)
            return refs[r.dp_rank, scheme]
        return rank_refs

    rows = []
    reads_workspace = picked == VLLM_CUTLASS and _cutlass_reads_workspace()
    for fmt in formats:
        scheme = reference_scheme(design, fmt, layout, kernel=picked)
        label = f"{AUTO}: {picked}" if backend == AUTO else backend
        modelled = reads_workspace and support.stock_hole(
            design, fmt, layout_name, picked, cutlass_reads_workspace=True) == \
            support.WRONG_ROUTES
        carried = carried_split(scenario.gate_up_split, design, fmt, picked)
        rows.append(judge(fmt, layout_name, label, ranks, refs_for(scheme), scheme=scheme,
                          release=(version, design), capability=capability,
                          modelled_hole=modelled, carried=carried,
                          check=lambda r, fmt=fmt: (r.info[f"{fmt}/plugin"].get("check")
                                                    or (None,))[0]))
    return rows


def _cutlass_reads_workspace() -> bool:
    """The installed vLLM's CUTLASS NVFP4 MoE reads the unzeroed row for non-local routes
    (the plugin's findings; ``support.stock_hole``)."""
    from vllm_fp4_moe_plugin.patches import compat, nvfp4_oracle

    return nvfp4_oracle.routes_needed(compat.probe().findings)


#: Layouts whose oracle-design TRT-LLM rows are run (vLLM 0.34.0): every layout of the
#: matrix, each under its own prepare/finalize (monolithic experts without all-to-all kernels,
#: TrtLlmNvFp4ExpertsModular under DP+EP, :func:`trtllm_routes_itself`).
ORACLE_TRTLLM_LAYOUTS = ("single", "pp", "tp", "tp_ep", "tp_all2allv", "dp_ep_allgather",
                         "dp_ep_all2allv", "dp", "dp_ep_one_sided")


def default_backends() -> tuple[str, ...]:
    """The matrix's backends when none are asked for: CUTLASS and TRT-LLM on every design.
    TRT-LLM is what vLLM picks first for NVFP4 MoE on SM100 from 0.14.0 on
    (oracle/nvfp4.py:238-247, read on v0.34.0), so the default matrix -- the one CI runs and
    docs/ publishes -- must hold its rows; on 0.11.0 they are the ModelOpt layouts
    its TRT-LLM path has (``trtllm_seam.applies``). An oracle-design vLLM whose TRT-LLM experts
    the seam cannot simulate (v0.14.0, whose TRT-LLM path is FlashInfer 0.5.3's kernel
    called from model_executor/layers/quantization/utils/flashinfer_fp4_moe.py:253-424; see
    :func:`~.blackwell_oracle.simulates_trtllm`) gets CUTLASS only."""
    from fp4_moe_lab.simulation import blackwell_oracle

    if blackwell_oracle.applies() and not blackwell_oracle.simulates_trtllm():
        return (BACKEND,)
    return (BACKEND, "flashinfer_trtllm")


def run_matrix(layouts: Optional[Iterable[str]] = None, scenario: Optional[Scenario] = None,
               formats=("modelopt", "compressed-tensors"),
               backends: Optional[Iterable[str]] = None,
               capability: str = gpus.DEFAULT_CAPABILITY) -> list[Row]:
    """``layouts`` default: :func:`~.layouts.default_layouts` of the installed vLLM;
    ``backends`` default: :func:`default_backends`; ``capability``: the simulated GPU
    (oracle design only; 0.11.x's seam and TRT-LLM rows are SM100's)."""
    from fp4_moe_lab.simulation import blackwell_oracle
    from fp4_moe_lab.simulation.layouts import default_layouts

    oracle = blackwell_oracle.applies()
    layouts = default_layouts() if layouts is None else layouts
    backends = tuple(default_backends() if backends is None else backends)
    scenario = scenario or Scenario()
    design = installed_release()[1]
    if not blackwell_oracle.simulates_capability(capability):  # before any rank starts
        raise NotImplementedError(f"capability {capability} is not simulated on this vLLM "
                                  "(blackwell_oracle.simulates_capability)")
    if VLLM_CUTLASS in backends and not (blackwell_oracle.takes_moe_backend()
                                         and blackwell_oracle.simulates_vllm_cutlass()):
        raise NotImplementedError("--backend vllm_cutlass is vLLM's --moe-backend cutlass, "
                                  "simulated where CutlassExpertsFp4 has its own device probe "
                                  "and the NVFP4 experts ops (read on 0.34.0)")
    if AUTO in backends and not blackwell_oracle.takes_moe_backend():
        raise NotImplementedError("--backend auto is vLLM's --moe-backend auto, which this "
                                  "vLLM does not have (KernelConfig.moe_backend, 0.20.0+)")
    rows: list[Row] = []
    for name in layouts:
        if BACKEND in backends:
            rows.extend(rows_for_layout(name, scenario, formats, capability=capability))
        if VLLM_CUTLASS in backends:
            rows.extend(rows_for_layout(name, scenario, formats, backend=VLLM_CUTLASS,
                                        capability=capability))
        if AUTO in backends and name in ORACLE_TRTLLM_LAYOUTS:
            rows.extend(rows_for_layout(name, scenario, formats, backend=AUTO,
                                        capability=capability))
        if trtllm_rows.BACKEND not in backends:
            continue
        if oracle:  # vLLM 0.14.0+: the oracle picks FLASHINFER_TRTLLM
            if name in ORACLE_TRTLLM_LAYOUTS:
                rows.extend(rows_for_layout(name, scenario, formats,
                                            backend=trtllm_rows.BACKEND, capability=capability))
        elif trtllm_rows.applies(name, formats, design):
            rows.extend(trtllm_rows.rows_for_layout(name, scenario))  # vLLM 0.11.0's TRT-LLM
    return rows


def _err(row: Row, error, rel_err: float) -> str:
    return "vLLM refuses" if row.vllm_refuses else "fails" if error else f"{rel_err:.3g}"


def format_table(rows: list[Row], with_capability: bool = False,
                 with_case: bool = False) -> str:
    """The matrix as text; ``with_capability``: a first column naming each row's GPU (rows of
    several ``--capability`` in one table); ``with_case``: a column naming each row's fixture."""
    head = ("format", "layout", "backend", "stock err", "plugin err", "bound", "noise floor",
            "plugin vs fp32", "hole", "plugin == stock", "ok")
    body = [(r.format, r.layout, r.backend,
             _err(r, r.stock_error, r.stock_rel_err), _err(r, r.plugin_error, r.plugin_rel_err),
             f"{r.bound:.0e}", f"{r.noise_floor:.3g}", f"{r.plugin_fp32_err:.3g}",
             "yes" if r.stock_affected else "no", "bit-identical" if r.bit_identical else "no",
             "yes" if r.ok else "NO") for r in rows]
    if with_case:
        head = ("case",) + head
        body = [(r.case or "-",) + b for r, b in zip(rows, body)]
    if with_capability:
        head = ("GPU",) + head
        body = [(r.capability,) + b for r, b in zip(rows, body)]
    widths = [max(len(str(c)) for c in col) for col in zip(head, *body)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    lines += [fmt.format(*b) for b in body]
    return "\n".join(lines)
