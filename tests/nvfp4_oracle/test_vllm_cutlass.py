# SPDX-License-Identifier: Apache-2.0
"""vLLM's own CUTLASS NVFP4 MoE kernel (``--moe-backend cutlass``, ``CutlassExpertsFp4``) on CPU.

The seam (``simulated_blackwell(backend="vllm_cutlass")``) replaces only the CUDA ops
``run_cutlass_moe_fp4`` calls (v0.34.0 FM/experts/cutlass_moe.py:511-704), its Triton route
remap and the experts' device probe (:723-730, 10.x and 12.x kept). First each emulated op
against a direct float computation; then vLLM's whole layer. vLLM's CUTLASS is no global-sf
backend (FM/oracle/nvfp4.py:69-83): one GEMM1 and one GEMM2 scale per local expert, quantized
after dispatch, so no layout has a scale hole and the plugin must be inert (bit-identical).

Not a scale hole, and measured: under EP (0.32.0+) a route to a non-local expert (id -1 after
the remap) is pointed at row ``expert_offsets[E]`` of GEMM2's output (csrc moe_data.cu
``compute_arg_sorts``: "c2 is initialized to zeros"), but 0.34.0's Python takes that output from
an unzeroed workspace (cutlass_moe.py:643-645, ``_resize_cache(workspace13, ...)``), which holds
GEMM1's output or earlier layers' data. With the seam's workspaces poisoned (NaN, memory nobody
initialised), stock gives every token with a non-local route NaN under TP+EP and DP+EP; the
plugin's wrapper (patches/nvfp4_oracle/non_local_routes.py) gives them exactly nothing, and the
rows sit at the NVFP4 bound. :func:`test_non_local_routes_read_the_unzeroed_workspace` shows the
mechanism on the function itself.
"""

import pytest
import torch

from fp4_moe_lab import nvfp4
from fp4_moe_lab.simulation import blackwell_oracle
from fp4_moe_lab.simulation import oracle_vllm_cutlass as ovc
from fp4_moe_lab.simulation.layouts import LAYOUTS, Scenario, run_layout
from fp4_moe_lab.simulation.matrix import VLLM_CUTLASS, rows_for_layout
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND
from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.patches.nvfp4_oracle import non_local_routes, probe

CAPABILITIES = ("10.0", "12.0")  # B200, RTX PRO 6000: both families CutlassExpertsFp4 takes


def _skip_unless_simulated() -> None:
    if not (blackwell_oracle.takes_moe_backend() and blackwell_oracle.simulates_vllm_cutlass()):
        pytest.skip("this vLLM has no --moe-backend cutlass with the NVFP4 experts ops the seam "
                    "simulates (read on 0.34.0)")


def _skip_unless_ep() -> None:
    """vLLM's CUTLASS NVFP4 MoE runs under EP from 0.32.0 (an expert map); before, vLLM refuses
    EP for it (``ep_size == 1``, v0.31.0 FM/experts/cutlass_moe.py:736)."""
    _skip_unless_simulated()
    if not probe.cutlass_fp4_takes_expert_map():
        pytest.skip("this vLLM's CUTLASS NVFP4 MoE takes no expert map (EP refused)")


# --- the emulated ops, each against a direct float computation ---------------------------------

def _routing(m: int, e: int, topk: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(e, generator=g)[:topk] for _ in range(m)]).to(torch.int32)


def _mm_data(topk_ids: torch.Tensor, e: int, n: int, k: int):
    numel = topk_ids.numel()
    t = {name: torch.full(shape, -7, dtype=torch.int32) for name, shape in (
        ("expert_offsets", (e + 1,)), ("blockscale_offsets", (e + 1,)),
        ("problem_sizes1", (e, 3)), ("problem_sizes2", (e, 3)),
        ("a_map", (numel,)), ("c_map", (numel,)))}
    ovc.get_cutlass_moe_mm_data(topk_ids, t["expert_offsets"], t["problem_sizes1"],
                                t["problem_sizes2"], t["a_map"], t["c_map"], e, n, k,
                                t["blockscale_offsets"], is_gated=True)
    return t


def test_mm_data_sorts_routes_by_expert_with_128_row_scale_blocks():
    ids = _routing(150, 3, 2)
    ids[0, 1] = -1  # a route to no local expert
    t = _mm_data(ids, 3, 32, 64)
    counts = [int((ids == x).sum()) for x in range(3)]
    offsets = [0, counts[0], counts[0] + counts[1], sum(counts)]
    assert t["expert_offsets"].tolist() == offsets
    padded = [-(-c // 128) * 128 for c in counts]
    assert t["blockscale_offsets"].tolist() == [0, padded[0], padded[0] + padded[1], sum(padded)]
    assert t["problem_sizes1"].tolist() == [[c, 64, 64] for c in counts]  # (m, 2n, k)
    assert t["problem_sizes2"].tolist() == [[c, 64, 32] for c in counts]  # (m, k, n)
    flat = ids.reshape(-1)
    for route in range(flat.numel()):
        row = int(t["c_map"][route])
        if flat[route] == -1:
            assert row == offsets[-1]
            continue
        x = int(flat[route])
        assert offsets[x] <= row < offsets[x + 1]  # its expert's rows
        assert int(t["a_map"][row]) == route // 2  # the row holds that route's token
    assert sorted(t["c_map"][flat != -1].tolist()) == list(range(offsets[-1]))


def test_experts_quant_uses_each_experts_scale_and_its_scale_block():
    """Row ``r`` of expert ``x`` is quantized with ``gs[x]`` (codes and block scales equal to the
    per-expert quantizer's), and each scale sits where the 128x4 layout puts (row in expert,
    column) inside the block starting at ``blockscale_offsets[x]``."""
    ids = _routing(140, 3, 2, seed=1)
    k = 128
    t = _mm_data(ids, 3, 32, k)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(ids.numel(), k, generator=g) * 4).to(torch.bfloat16)
    gs = torch.tensor([0.5, 40.0, 3.0])  # far apart: a wrong expert's scale shows
    q, sf = ovc.scaled_fp4_experts_quant(x, gs, t["expert_offsets"], t["blockscale_offsets"], 2)
    assert q.shape == (x.shape[0], k // 2) and q.dtype == torch.uint8
    assert sf.dtype == torch.float8_e4m3fn
    raw = sf.view(torch.uint8).reshape(-1)
    row_bytes = (k // 16 + 3) // 4 * 4
    ks = k // 16
    for e in range(3):
        lo, hi = int(t["expert_offsets"][e]), int(t["expert_offsets"][e + 1])
        codes, want_sf = nvfp4.quantize_codes(x[lo:hi].float(), gs[e])
        assert torch.equal(nvfp4.unpack_fp4(q[lo:hi]), codes), e
        base = int(t["blockscale_offsets"][e]) * row_bytes
        for r in (0, (hi - lo) // 2, hi - lo - 1):
            for c in range(ks):
                byte = raw[base + nvfp4.sf_offset_128x4(r, c, ks)]
                assert byte == want_sf.view(torch.uint8)[r, c], (e, r, c)
        # and the values are x to NVFP4 accuracy with that expert's scale
        deq = nvfp4.dequantize(q[lo:hi], want_sf, gs[e])
        assert (deq - x[lo:hi].float()).norm() / x[lo:hi].float().norm() < 0.2


def test_fused_silu_mul_quant_is_silu_of_gate_times_up_then_per_expert_quant():
    ids = _routing(20, 2, 1, seed=3)
    t = _mm_data(ids, 2, 32, 64)
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(20, 64, generator=g) * 3).to(torch.bfloat16)  # gate || up, 32 each
    gs = torch.tensor([2.0, 9.0])
    q, sf = ovc.silu_and_mul_scaled_fp4_experts_quant(h, gs, t["expert_offsets"],
                                                      t["blockscale_offsets"], 1)
    act = (torch.nn.functional.silu(h[:, :32].float()) * h[:, 32:].float()).to(torch.bfloat16)
    assert q.shape == (20, 16)
    for e in range(2):
        lo, hi = int(t["expert_offsets"][e]), int(t["expert_offsets"][e + 1])
        codes, _ = nvfp4.quantize_codes(act[lo:hi].float(), gs[e])
        assert torch.equal(nvfp4.unpack_fp4(q[lo:hi]), codes), e


def test_grouped_gemm_is_the_dequantized_matmul_of_each_expert():
    """``out[rows of x] = alpha[x] * A_x @ W_x^T``: compared with plain dequantized tensors
    (linear scales, the checkpoint's global scales), over more than one 128-row and 4-column
    scale tile, leaving other rows untouched."""
    e, n_out, k = 2, 48, 128
    ids = _routing(300, e, 1, seed=5)  # ~150 rows per expert: two 128-row scale tiles
    t = _mm_data(ids, e, n_out // 2, k)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(300, k, generator=g).to(torch.bfloat16)
    a_gs = torch.tensor([1.5, 6.0])
    aq, asf = ovc.scaled_fp4_experts_quant(x, a_gs, t["expert_offsets"],
                                           t["blockscale_offsets"], 1)
    w = torch.randn(e, n_out, k, generator=g) * 0.1
    w_gs = torch.tensor([2000.0, 5000.0])
    wq, wsf = nvfp4.quantize(w, w_gs.reshape(-1, 1))
    alphas = 1.0 / (a_gs * w_gs)
    out = torch.full((300, n_out), 7.0, dtype=torch.bfloat16)
    ovc.cutlass_fp4_moe_mm(out, aq, wq, asf, nvfp4.swizzle_128x4(wsf), alphas,
                           t["problem_sizes1"], t["expert_offsets"][:-1],
                           t["blockscale_offsets"][:-1])
    w_deq = nvfp4.dequantize(wq, wsf, w_gs.reshape(-1, 1))
    for x_id in range(e):
        lo, hi = int(t["expert_offsets"][x_id]), int(t["expert_offsets"][x_id + 1])
        a = nvfp4.dequantize(*nvfp4.quantize(x[lo:hi].float(), a_gs[x_id]), a_gs[x_id])
        want = (a @ w_deq[x_id].T).to(torch.bfloat16).float()
        got = out[lo:hi].float()
        assert (got - want).norm() / want.norm() < 1e-2, x_id
    assert min(int(t["problem_sizes1"][x_id][0]) for x_id in range(e)) > 128
    assert int(t["expert_offsets"][-1]) == 300  # every row written: no 7.0 left
    assert not (out == 7.0).all(dim=1).any()


def test_remap_and_shuffle_rows():
    ids = torch.tensor([[0, 3], [2, -1]], dtype=torch.int32)
    emap = torch.tensor([-1, -1, 0, 1], dtype=torch.int32)
    assert ovc.remap_topk_to_local(ids, emap, out_dtype=torch.int32).tolist() == [[-1, 1],
                                                                                   [0, -1]]
    x = torch.arange(6.0).reshape(3, 2)
    assert ovc.shuffle_rows(x, torch.tensor([2, 0, 2], dtype=torch.int32)).tolist() == [
        [4.0, 5.0], [0.0, 1.0], [4.0, 5.0]]


# --- vLLM's own run_cutlass_moe_fp4 under the seam ----------------------------------------------

def test_non_local_routes_read_the_unzeroed_workspace():
    """vLLM 0.34.0's ``run_cutlass_moe_fp4`` itself, under EP (2 of 4 experts local): a token
    routed to local experts only gets the ideal NVFP4 answer; a token routed to non-local
    experts only gets ``weight * c3[expert_offsets[E]]``, a row of workspace13 that nothing
    zeroes: NaN when the workspace held NaN, 0 only when it held zeros."""
    _skip_unless_ep()
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.cutlass_moe import run_cutlass_moe_fp4

    e, n, k, m, topk = 2, 32, 64, 3, 2
    g = torch.Generator().manual_seed(7)
    experts = nvfp4.quantize_experts(torch.randn(e, n, k, generator=g) * 0.1,
                                     torch.randn(e, n, k, generator=g) * 0.1,
                                     torch.randn(e, k, n, generator=g) * 0.1,
                                     [8.0, 16.0], [4.0, 12.0])
    w13 = torch.cat([experts.w1, experts.w3], dim=1)  # vLLM's CUTLASS keeps [w1; w3]
    w13_sf = nvfp4.swizzle_128x4(torch.cat([experts.w1_sf, experts.w3_sf], dim=1))
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 3]], dtype=torch.int32)  # token 1: nothing local
    weights = torch.tensor([[0.6, 0.4], [0.5, 0.5], [0.7, 0.3]])
    expert_map = torch.tensor([0, 1, -1, -1], dtype=torch.int32)
    a1, a2 = experts.w13_input_gs, experts.w2_input_gs
    outs = {}
    with blackwell_oracle.simulated_blackwell(backend="vllm_cutlass"):
        for name, fill in (("nan", float("nan")), ("zeros", 0.0)):
            ws13 = torch.full((m * topk, max(2 * n, k)), fill, dtype=torch.bfloat16)
            ws2 = torch.full((m * topk, n), fill, dtype=torch.bfloat16)
            out = torch.empty(m, k, dtype=torch.bfloat16)
            run_cutlass_moe_fp4(
                out, x.clone(), a1, w13, w13_sf, 1.0 / (experts.w13_weight_gs * a1), a2,
                experts.w2, nvfp4.swizzle_128x4(experts.w2_sf),
                1.0 / (experts.w2_weight_gs * a2), weights, ids, MoEActivation.SILU, ws13, ws2,
                m, n, k, e, torch.device("cpu"), expert_map=expert_map)
            outs[name] = out.float()
    local = ids.clamp(max=e - 1).long()  # token 0's routes are its own ids
    ideal = nvfp4.moe_reference_nvfp4(x[:1], experts, weights[:1], local[:1], a1_gs=a1,
                                      intermediate_dtype=torch.bfloat16)
    for out in outs.values():
        assert (out[0] - ideal[0]).norm() / ideal[0].norm() < PLUGIN_BOUND
    assert torch.isnan(outs["nan"][1]).all()  # the workspace row, weighted
    assert torch.equal(outs["zeros"][1], torch.zeros(k))
    assert torch.isnan(outs["nan"][2]).all()  # a local and a non-local route: NaN too
    # the plugin's wrapper, on the same NaN workspace: token 0 as stock, token 1 exactly zero,
    # token 2 its local route alone
    ideal2 = nvfp4.moe_reference_nvfp4(x[2:], experts, torch.tensor([[0.7, 0.0]]),
                                       torch.tensor([[1, 0]]), a1_gs=a1,
                                       intermediate_dtype=torch.bfloat16)
    with blackwell_oracle.simulated_blackwell(backend="vllm_cutlass"):
        ws13 = torch.full((m * topk, max(2 * n, k)), float("nan"), dtype=torch.bfloat16)
        ws2 = torch.full((m * topk, n), float("nan"), dtype=torch.bfloat16)
        out = torch.empty(m, k, dtype=torch.bfloat16)
        non_local_routes.build(run_cutlass_moe_fp4)(
            out, x.clone(), a1, w13, w13_sf, 1.0 / (experts.w13_weight_gs * a1), a2,
            experts.w2, nvfp4.swizzle_128x4(experts.w2_sf),
            1.0 / (experts.w2_weight_gs * a2), weights, ids, MoEActivation.SILU, ws13, ws2,
            m, n, k, e, torch.device("cpu"), expert_map=expert_map)
    assert torch.equal(out[0], outs["zeros"][0])
    assert torch.equal(out[1], torch.zeros(k, dtype=torch.bfloat16))
    assert (out[2].float() - ideal2[0]).norm() / ideal2[0].norm() < PLUGIN_BOUND


# --- vLLM's whole layer, stock and plugin, in real process groups -------------------------------

_RANKS: dict = {}


def _ranks(layout: str, capability: str):
    """One run of a layout per capability for this module (both formats, stock and plugin)."""
    if (layout, capability) not in _RANKS:
        _RANKS[layout, capability] = run_layout(LAYOUTS[layout], Scenario(),
                                                backend="vllm_cutlass", capability=capability)
    return _RANKS[layout, capability]


def _rows(layout: str, capability: str):
    ranks = _ranks(layout, capability)
    for r in ranks:
        for key, info in r.info.items():
            assert info["backend"] == "VLLM_CUTLASS", (key, info)  # vLLM's choice, both GPUs
            assert info["experts"] == "CutlassExpertsFp4", (key, info)
    return rows_for_layout(layout, Scenario(), backend=VLLM_CUTLASS, ranks=ranks,
                           capability=capability)


def _no_hole_plugin_inert(row) -> None:
    assert row.capability in CAPABILITIES and not row.vllm_refuses, row
    assert row.stock_error is None and row.plugin_error is None, row
    assert row.reference_scheme == "per_expert", row
    assert support.stock_hole("nvfp4_oracle", row.format, row.layout, row.backend) is None
    assert row.stock_rel_err < AFFECTED_FACTOR * PLUGIN_BOUND and not row.stock_affected, row
    assert row.bit_identical, row


@pytest.mark.multiproc
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_single_rows_ok_stock_at_the_bound_plugin_bit_identical(capability):
    _skip_unless_simulated()
    for row in _rows("single", capability):
        _no_hole_plugin_inert(row)
        assert row.plugin_rel_err <= PLUGIN_BOUND, row
        assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
        assert row.ok, row


@pytest.mark.multiproc
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_dp_ep_allgather_keeps_per_local_expert_scales(capability):
    """Each EP rank's GEMM1 scales are its own experts' (``a1_gscale`` = that rank's slice of
    the per-expert input global scales): no scale hole, stock and plugin alike."""
    _skip_unless_ep()
    gs = Scenario().experts().w13_input_gs
    for r in _ranks("dp_ep_allgather", capability):
        half = gs.numel() // 2
        mine = gs[r.rank * half:(r.rank + 1) * half]
        for key, info in r.info.items():
            assert torch.allclose(torch.tensor(info["a1_gscale"]), mine, rtol=1e-6), key
    for row in _rows("dp_ep_allgather", capability):
        assert support.stock_hole("nvfp4_oracle", row.format, row.layout, row.backend) is None
        assert row.reference_scheme == "per_expert", row


# GEMM1's output (2 x intermediate) no wider than the hidden size, as in DeepSeek-R1 (2 x 2048 <=
# 7168): the row non-local routes read lies past GEMM1's output, in memory this layer did not
# write (with the default fixture, 2 x 512 > 256, it holds GEMM1's output: stock 0.018-0.02)
ROUTES_SCENARIO = Scenario(hidden=512, intermediate=256)


@pytest.mark.multiproc
@pytest.mark.parametrize("layout, capability", [("dp_ep_allgather", "10.0"),
                                                ("dp_ep_allgather", "12.0"), ("tp_ep", "10.0")])
def test_ep_rows_stock_reads_the_workspace_plugin_within_the_bound(layout, capability):
    """Under EP stock adds the poisoned workspace row for each non-local route (NaN, far from
    the bound); the plugin's rows sit at the NVFP4 bound, in both formats."""
    _skip_unless_ep()
    ranks = run_layout(LAYOUTS[layout], ROUTES_SCENARIO, backend="vllm_cutlass",
                       capability=capability)
    for row in rows_for_layout(layout, ROUTES_SCENARIO, backend=VLLM_CUTLASS, ranks=ranks,
                               capability=capability):
        assert support.stock_hole("nvfp4_oracle", row.format, layout, row.backend,
                                  cutlass_reads_workspace=True) == support.WRONG_ROUTES
        assert row.stock_error is None and row.plugin_error is None, row
        assert row.stock_affected and row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
        assert row.plugin_rel_err <= PLUGIN_BOUND, row
        assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
        assert row.ok, row
