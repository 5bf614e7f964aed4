# SPDX-License-Identifier: Apache-2.0
"""The FlashInfer 0.3.1 ``trtllm_fp4_block_scale_moe`` emulator: layout, routing, numerics, bugs.

Bounds (relative Frobenius error ||a-b||/||b||):

* IDEAL_BOUND (emulator vs the all-fp32 ideal ``moe_reference_nvfp4`` fed the kernel's own
  routing): what separates them is only where the kernel rounds -- bf16 GEMM2 outputs (unit
  roundoff 2^-9 ~ 2e-3), bf16 final output, and the GEMM2-input quantization done on
  ``v = a2_gs * act`` instead of on ``act`` (a different fp32 operation order, which moves an
  FP4 code now and then). Unlike the CUTLASS kernel (IDEAL_BOUND 0.15 in test_moe_emulator.py),
  GEMM1's output is not stored in bf16 before SwiGLU, so no bf16 rounding feeds GEMM2's
  quantization. Measured over the parametrization below (2 routings x 3 EP slices x 3 M x 2
  seeds): 1.8e-3 to 2.7e-3, i.e. about one bf16 rounding -> bound 1e-2 (3.7x margin).
* BUG_FACTOR: a wrong scale must land at least BUG_FACTOR x IDEAL_BOUND away (measured: a
  ``g1_scale_c`` built from a 4x different GEMM2 activation scale gives 3.0; the stock vLLM
  0.11.0 expert-0 activation scale with a 4x spread 0.80 / 2.56; swizzled activation scales
  read as linear, see the test).
"""

import os

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")  # vLLM's grouped_topk is @torch.compile'd

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from fp4_moe_lab.nvfp4 import (  # noqa: E402
    fp4_quantize,
    moe_reference_nvfp4,
    trtllm_fp4_block_scale_moe,
)
from fp4_moe_lab.nvfp4 import layout as nvfp4_layout  # noqa: E402
from fp4_moe_lab.nvfp4.trtllm_emulator import (  # noqa: E402
    route,
    trtllm_fp4_block_scale_moe_0_7,
    trtllm_fp4_block_scale_routed_moe_0_7,
)
from fp4_moe_lab.nvfp4.trtllm_layout import (  # noqa: E402
    gated_row_sources,
    gemm1_row_sources,
    shuffle_gemm1,
    shuffle_gemm2,
    to_trtllm_inputs,
    unshuffle_gemm1,
    unshuffle_gemm2,
)

from .moe_cases import make_case, rel_err  # noqa: E402

BF16 = torch.bfloat16
RENORMALIZE, DEEPSEEK_V3 = 1, 2
# (E, H, I): 2I and H multiples of 128, H/16 and I/16 multiples of 4 -- whole 128x4 scale tiles,
# which vLLM 0.11.0's reshape of the interleaved scales needs (modelopt.py:1270-1281).
SHAPE = (16, 128, 64)
ROWS = [1, 7, 64]
SEEDS = [0, 1]
# (ep_size, ep_rank): the rank's experts start at local_expert_offset = rank * E / ep_size.
EP_SLICES = [(1, 0), (2, 1), (4, 2)]
TILES = [128, 64]  # epilogue_tile_m: shuffle blocks of 32 (vLLM's 128) and of 16
IDEAL_BOUND = 1e-2
BUG_FACTOR = 10.0
ROUTINGS = {
    # name: (routing_method_type, top_k, n_group, topk_group, routed_scaling_factor)
    "renormalize": (RENORMALIZE, 2, None, None, None),
    "deepseek_v3": (DEEPSEEK_V3, 4, 4, 2, 2.5),
}


def _logits_and_bias(m, num_experts, method, seed, device):
    gen = torch.Generator().manual_seed(500 + seed)
    logits = torch.randn(m, num_experts, generator=gen)
    if method == DEEPSEEK_V3:  # vLLM 0.11.0: fp32 logits, bf16 bias (modelopt.py:1457-1463)
        bias = (torch.randn(num_experts, generator=gen) * 0.2).to(BF16)
        return logits.float().to(device), bias.to(device)
    return logits.to(BF16).to(device), None  # Renormalize reads bf16 logits


def _call(case_x, experts, logits, bias, routing, *, a1_gs, ep=(1, 0), kernel_inputs=None,
          x_override=None):
    method, top_k, n_group, topk_group, rsf = routing
    ep_size, ep_rank = ep
    e_local = experts.num_experts // ep_size
    lo = ep_rank * e_local
    if kernel_inputs is None:
        local = experts.experts_slice(lo, lo + e_local)
        g = a1_gs if a1_gs.dim() == 0 else a1_gs[lo:lo + e_local]
        kernel_inputs = to_trtllm_inputs(local, a1_gs=g)
    if x_override is None:
        # vLLM 0.11.0: fp4_quantize(x, w13_input_scale_quant, is_sf_swizzled_layout=False),
        # scales passed flattened as float8 (modelopt.py:1446-1451, 1465-1466).
        xq, xsf = fp4_quantize(case_x, a1_gs, is_sf_swizzled_layout=False)
        x_override = (xq, xsf.view(torch.float8_e4m3fn).flatten())
    out = trtllm_fp4_block_scale_moe(
        logits, bias, x_override[0], x_override[1], gemm1_bias=None, gemm1_alpha=None,
        gemm1_beta=None, gemm1_clamp_limit=None, gemm2_bias=None,
        num_experts=experts.num_experts, top_k=top_k, n_group=n_group, topk_group=topk_group,
        intermediate_size=experts.intermediate, local_expert_offset=lo,
        local_num_experts=e_local, routed_scaling_factor=rsf, routing_method_type=method,
        **kernel_inputs)
    return out[0], lo, e_local


def _reference(case_x, experts, logits, bias, routing, *, a1_gs, lo, e_local):
    """The ideal NVFP4 oracle, all fp32, fed the kernel's routing with non-local routes
    weighted 0 (what this EP rank contributes)."""
    method, top_k, n_group, topk_group, rsf = routing
    ids, w = route(logits, bias, routing_method_type=method, top_k=top_k, n_group=n_group,
                   topk_group=topk_group, routed_scaling_factor=rsf)
    local = (ids >= lo) & (ids < lo + e_local)
    return moe_reference_nvfp4(case_x, experts, w.float() * local, ids, a1_gs=a1_gs)


# ---------------------------------------------------------------------------------------------
# Layout: FlashInfer's own shuffles, bit for bit.


def _flashinfer_sf_shuffle(monkeypatch, device):
    """FlashInfer 0.3.1's ``shuffle_matrix_sf_a``. Its last step, ``block_scale_interleave``,
    asks ``torch.cuda.get_device_capability()`` to JIT-build a CUDA module
    (fi fp4_quantization.py:398-403), so off SM100 it is replaced by the project's mirror, which
    test_agreement.py checks byte for byte against vLLM's ``swizzle_blockscale``. The row
    permutation under test is FlashInfer's own (``get_shuffle_matrix_sf_a_row_indices``)."""
    fp4q = pytest.importorskip("flashinfer.fp4_quantization")
    if device.type == "cpu" or torch.cuda.get_device_capability(device)[0] != 10:
        # Off SM100 (CPU, or a Hopper box under VLLM_FP4_MOE_TEST_DEVICE=cuda) the JIT module
        # is not there to build either.
        monkeypatch.setattr(fp4q, "block_scale_interleave", nvfp4_layout.block_scale_interleave)
    return fp4q.shuffle_matrix_sf_a


@pytest.mark.parametrize("tile", TILES)
def test_gemm1_unshuffle_round_trips_flashinfer_shuffles(tile, device, monkeypatch):
    flashinfer = pytest.importorskip("flashinfer")
    core = pytest.importorskip("flashinfer.fused_moe.core")
    shuffle_sf = _flashinfer_sf_shuffle(monkeypatch, device)
    gen = torch.Generator().manual_seed(tile)
    e, rows, cols = 3, 256, 64  # [w3; w1] rows, packed bytes (H = 128)
    w = torch.randint(0, 256, (e, rows, cols), generator=gen, dtype=torch.uint8).to(device)
    sf = torch.randint(0, 127, (e, rows, cols // 8), generator=gen, dtype=torch.uint8).to(device)
    # FlashInfer's chain as vLLM 0.11.0 runs it (modelopt.py:1226-1281).
    fi_w = torch.stack([flashinfer.shuffle_matrix_a(
        flashinfer.reorder_rows_for_gated_act_gemm(w[i]), tile) for i in range(e)])
    fi_sf = torch.stack([shuffle_sf(flashinfer.reorder_rows_for_gated_act_gemm(sf[i]), tile)
                         for i in range(e)]).reshape(e, rows, cols // 8)
    ours_w, ours_sf = shuffle_gemm1(w, sf.view(torch.float8_e4m3fn), tile)
    # Reference check: FlashInfer's shuffles, and its cached permutation (fi core.py:169-193).
    assert torch.equal(ours_w, fi_w)
    assert torch.equal(ours_sf.view(torch.uint8), fi_sf)
    perm = core._maybe_get_cached_w3_w1_permute_indices({}, w[0], tile)
    assert torch.equal(gemm1_row_sources(rows, tile), perm.cpu())
    back_w, back_sf = unshuffle_gemm1(fi_w, fi_sf.view(torch.float8_e4m3fn), tile)
    assert torch.equal(back_w, w) and torch.equal(back_sf.view(torch.uint8), sf)
    assert torch.equal(gated_row_sources(rows)[:4], torch.tensor([0, rows // 2, 1, rows // 2 + 1]))


@pytest.mark.parametrize("tile", TILES)
def test_gemm2_unshuffle_round_trips_flashinfer_shuffles(tile, device, monkeypatch):
    flashinfer = pytest.importorskip("flashinfer")
    shuffle_sf = _flashinfer_sf_shuffle(monkeypatch, device)
    gen = torch.Generator().manual_seed(10 + tile)
    e, rows, cols = 2, 128, 32  # H rows, I/2 packed bytes (I = 64)
    w = torch.randint(0, 256, (e, rows, cols), generator=gen, dtype=torch.uint8).to(device)
    sf = torch.randint(0, 127, (e, rows, cols // 8), generator=gen, dtype=torch.uint8).to(device)
    fi_w = torch.stack([flashinfer.shuffle_matrix_a(w[i], tile) for i in range(e)])
    fi_sf = torch.stack([shuffle_sf(sf[i], tile) for i in range(e)]).reshape(e, rows, cols // 8)
    ours_w, ours_sf = shuffle_gemm2(w, sf.view(torch.float8_e4m3fn), tile)
    # Reference check: FlashInfer's shuffle_matrix_a / shuffle_matrix_sf_a, byte for byte.
    assert torch.equal(ours_w, fi_w) and torch.equal(ours_sf.view(torch.uint8), fi_sf)
    back_w, back_sf = unshuffle_gemm2(fi_w, fi_sf.view(torch.float8_e4m3fn), tile)
    assert torch.equal(back_w, w) and torch.equal(back_sf.view(torch.uint8), sf)
    assert not torch.equal(fi_w, w)  # the shuffle really moves rows


def test_builder_matches_vllm_prepare(device, monkeypatch):
    modelopt = pytest.importorskip("vllm.model_executor.layers.quantization.modelopt")
    flashinfer = pytest.importorskip("flashinfer")
    _flashinfer_sf_shuffle(monkeypatch, device)
    if device.type == "cpu":
        # vLLM hands FlashInfer's reorder float8 views (modelopt.py:1211-1232); torch 2.8 has no
        # CPU indexing kernel for float8, so run FlashInfer's own function on the same bytes.
        reorder = flashinfer.reorder_rows_for_gated_act_gemm
        monkeypatch.setattr(flashinfer, "reorder_rows_for_gated_act_gemm",
                            lambda x: reorder(x.view(torch.uint8)).view(x.dtype))
    case = make_case(*SHAPE, 1, seed=0, device=device)
    ex = case.experts
    ours = to_trtllm_inputs(ex, a1_gs=ex.w13_input_gs)
    w13 = torch.cat([ex.w3, ex.w1], dim=1)  # after reorder_w1w3_to_w3w1 (modelopt.py:1290)
    w13_sf = torch.cat([ex.w3_sf, ex.w1_sf], dim=1)
    # Reference check: vLLM 0.11.0's own preparation (it never reads `self`).
    want = modelopt.ModelOptNvFp4FusedMoE.prepare_static_weight_layouts_for_trtllm_moe(
        None, w13, ex.w2, w13_sf, ex.w2_sf, ex.hidden, ex.intermediate, ex.num_experts)
    names = ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale")
    for name, w in zip(names, want):
        assert ours[name].dtype == w.dtype and ours[name].shape == w.shape, name
        assert torch.equal(ours[name].view(torch.uint8), w.view(torch.uint8)), name


# ---------------------------------------------------------------------------------------------
# Routing.


def _renormalize_reference(logits, top_k):
    """TopK -> softmax over the k (FlashInfer's test reference, fi tests/
    test_trtllm_gen_fused_moe.py:1149-1163), on the bf16 logits the kernel reads."""
    vals, ids = torch.topk(logits.float(), top_k, dim=-1)
    return ids, torch.softmax(vals, dim=-1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_routing_matches_model_routing(routing, seed, device):
    method, top_k, n_group, topk_group, rsf = ROUTINGS[routing]
    logits, bias = _logits_and_bias(64, SHAPE[0], method, seed, device)
    ids, w = route(logits, bias, routing_method_type=method, top_k=top_k, n_group=n_group,
                   topk_group=topk_group, routed_scaling_factor=rsf)
    assert ids.dtype == torch.int32 and w.dtype == BF16 and ids.shape == (64, top_k)
    if method == DEEPSEEK_V3:
        fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
        grouped = getattr(fused_moe.grouped_topk, "_torchdynamo_orig_callable",
                          fused_moe.grouped_topk)
        want_w, want_ids = grouped(logits, logits, top_k, True, n_group, topk_group,
                                   "sigmoid", rsf, bias)
    else:
        want_ids, want_w = _renormalize_reference(logits, top_k)
    # Reference check: vLLM 0.11.0's grouped_topk (what DeepSeek-V3 means) / TopK->softmax;
    # the same experts, weights within one bf16 rounding.
    order, want_order = ids.long().sort(dim=-1), want_ids.long().sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    got = w.float().gather(1, order.indices)
    ref = want_w.float().gather(1, want_order.indices)
    assert torch.allclose(got, ref, rtol=2 ** -8, atol=0)
    if method == DEEPSEEK_V3:  # routed_scaling_factor really scales the weights
        assert torch.allclose(w.float().sum(-1), torch.full((64,), rsf, device=device),
                              rtol=1e-2)


def test_routing_ties_go_to_the_lower_expert(device):
    logits = torch.zeros(1, 8, dtype=BF16, device=device)
    ids, w = route(logits, None, routing_method_type=RENORMALIZE, top_k=3)
    # Reference check: fi RoutingKernelTopK.cuh:51-59 (65535 - idx breaks ties).
    assert ids.tolist() == [[0, 1, 2]]
    assert torch.equal(w.float(), torch.full((1, 3), 1 / 3, device=device).to(BF16).float())


# ---------------------------------------------------------------------------------------------
# Numerics against the ideal NVFP4 reference (uniform input scales: stock is consistent).


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("ep", EP_SLICES, ids=lambda p: f"ep{p[0]}r{p[1]}")
@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_agrees_with_ideal_reference(routing, ep, m, seed, device):
    case = make_case(*SHAPE, m, seed=seed, device=device, spread=1.0)
    gs = case.experts.w13_input_gs
    assert torch.all(gs == gs[0])  # the scale fp4_quantize reads IS every expert's scale
    logits, bias = _logits_and_bias(m, SHAPE[0], ROUTINGS[routing][0], seed, device)
    out, lo, e_local = _call(case.x, case.experts, logits, bias, ROUTINGS[routing], a1_gs=gs,
                             ep=ep)
    assert out.dtype == BF16 and out.shape == (m, SHAPE[1]) and out.device == case.x.device
    ref = _reference(case.x, case.experts, logits, bias, ROUTINGS[routing], a1_gs=gs, lo=lo,
                     e_local=e_local)
    if float(ref.norm()) == 0.0:  # no route of these tokens lands on this EP slice
        assert torch.count_nonzero(out) == 0
        return
    err = rel_err(out, ref)
    print(f"\n[trtllm-ideal] {routing} ep={ep} m={m} seed={seed}: {err:.2e}")
    # Reference check: the ideal all-fp32 NVFP4 oracle with the kernel's routing.
    assert 0.0 < err <= IDEAL_BOUND


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_expert_parallel_slices_sum_to_the_whole_layer(routing, device):
    case = make_case(*SHAPE, 64, seed=3, device=device, spread=1.0)
    gs = case.experts.w13_input_gs
    logits, bias = _logits_and_bias(64, SHAPE[0], ROUTINGS[routing][0], 3, device)
    full, _, _ = _call(case.x, case.experts, logits, bias, ROUTINGS[routing], a1_gs=gs)
    total = sum(_call(case.x, case.experts, logits, bias, ROUTINGS[routing], a1_gs=gs,
                      ep=(4, r))[0].float() for r in range(4))
    # Reference check: the unsharded call; only per-rank bf16 rounding of the output differs.
    assert rel_err(total, full) <= 1e-2


# ---------------------------------------------------------------------------------------------
# The emulator shows scale bugs.


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_wrong_output1_scale_scalar_is_visible(routing, device):
    case = make_case(*SHAPE, 64, seed=4, device=device, spread=1.0)
    ex, gs = case.experts, case.experts.w13_input_gs
    logits, bias = _logits_and_bias(64, SHAPE[0], ROUTINGS[routing][0], 4, device)
    good = to_trtllm_inputs(ex, a1_gs=gs)
    # g1_scale_c built from another activation scale: the GEMM2 input scale of a layer whose
    # calibration saw 4x smaller activations (w2_input_scale_quant 4x larger).
    bad = dict(good, output1_scale_scalar=to_trtllm_inputs(
        ex, a1_gs=gs, a2_gs=ex.w2_input_gs * 4)["output1_scale_scalar"])
    ok, _, _ = _call(case.x, ex, logits, bias, ROUTINGS[routing], a1_gs=gs, kernel_inputs=good)
    wrong, _, _ = _call(case.x, ex, logits, bias, ROUTINGS[routing], a1_gs=gs, kernel_inputs=bad)
    ref = _reference(case.x, ex, logits, bias, ROUTINGS[routing], a1_gs=gs, lo=0,
                     e_local=ex.num_experts)
    err_ok, err_wrong = rel_err(ok, ref), rel_err(wrong, ref)
    print(f"\n[trtllm-bug] {routing}: right scalar {err_ok:.2e}, wrong g1_scale_c {err_wrong:.2f}")
    # Reference check: the ideal oracle; the right scalars within the bound, the wrong one
    # at least BUG_FACTOR x the bound away.
    assert err_ok <= IDEAL_BOUND and err_wrong >= BUG_FACTOR * IDEAL_BOUND


@pytest.mark.parametrize("largest", [True, False], ids=["expert0-largest", "expert0-smallest"])
def test_stock_vllm_vector_scale_is_wrong_and_one_scalar_is_right(largest, device):
    """vLLM 0.11.0 quantizes with ``w13_input_scale_quant`` ([E]; fp4_quantize reads element 0)
    but builds ``g1_alphas``/``g1_scale_c`` per expert; the plugin sets every element to the min
    and rebuilds both (patches/init_prepare_finalize/methods.py ``_fp4_set_trtllm_scales``)."""
    case = make_case(*SHAPE, 64, seed=5, device=device, spread=4.0)
    ex = case.experts
    gs = ex.w13_input_gs.clone()
    i = int(gs.argmax() if largest else gs.argmin())
    gs[0], gs[i] = ex.w13_input_gs[i], ex.w13_input_gs[0]
    ex = dataclasses.replace(ex, w13_input_gs=gs)
    routing = ROUTINGS["deepseek_v3"]
    logits, bias = _logits_and_bias(64, SHAPE[0], DEEPSEEK_V3, 5, device)
    stock, _, _ = _call(case.x, ex, logits, bias, routing, a1_gs=gs)
    g = gs.min().reshape(())
    fixed, _, _ = _call(case.x, ex, logits, bias, routing, a1_gs=g)
    # Reference check: the ideal per-expert oracle (each expert's own calibration) and the
    # oracle with the one shared scalar the fix uses.
    ideal = _reference(case.x, ex, logits, bias, routing, a1_gs=gs, lo=0, e_local=16)
    shared = _reference(case.x, ex, logits, bias, routing, a1_gs=g, lo=0, e_local=16)
    err_stock, err_fixed = rel_err(stock, ideal), rel_err(fixed, shared)
    print(f"\n[trtllm-stock] expert0={'max' if largest else 'min'}: stock {err_stock:.2f}, "
          f"fixed {err_fixed:.2e}")
    assert err_fixed <= IDEAL_BOUND and err_stock >= BUG_FACTOR * IDEAL_BOUND


# ---------------------------------------------------------------------------------------------
# Activation block-scale layout.


def test_hidden_states_scale_is_read_as_linear(device):
    """At M % 128 == 0 a 128x4-swizzled buffer has the linear size, so the launcher's size check
    (fi launcher.cu:886-889) passes and the kernel reads it as linear: wrong, silently."""
    case = make_case(*SHAPE, 128, seed=6, device=device, spread=1.0)
    gs, routing = case.experts.w13_input_gs, ROUTINGS["renormalize"]
    logits, bias = _logits_and_bias(128, SHAPE[0], RENORMALIZE, 6, device)
    xq, lin = fp4_quantize(case.x, gs, is_sf_swizzled_layout=False)
    _, swz = fp4_quantize(case.x, gs, is_sf_swizzled_layout=True)
    assert swz.numel() == lin.numel() and not torch.equal(swz, lin)
    right, _, _ = _call(case.x, case.experts, logits, bias, routing, a1_gs=gs,
                        x_override=(xq, lin.view(torch.float8_e4m3fn).flatten()))
    misread, _, _ = _call(case.x, case.experts, logits, bias, routing, a1_gs=gs,
                          x_override=(xq, swz.view(torch.float8_e4m3fn).flatten()))
    ref = _reference(case.x, case.experts, logits, bias, routing, a1_gs=gs, lo=0, e_local=16)
    # Reference check: linear scales give the oracle's answer, swizzled ones do not.
    assert rel_err(right, ref) <= IDEAL_BOUND
    assert rel_err(misread, ref) >= BUG_FACTOR * IDEAL_BOUND
    _, swz7 = fp4_quantize(case.x[:7], gs, is_sf_swizzled_layout=True)  # padded: wrong size
    with pytest.raises(RuntimeError, match="hidden_states_scale"):
        _call(case.x[:7], case.experts, logits[:7], bias, routing, a1_gs=gs,
              x_override=(xq[:7], swz7.view(torch.float8_e4m3fn).flatten()))


# ---------------------------------------------------------------------------------------------
# What is not emulated raises.


def _base_kwargs(device):
    case = make_case(*SHAPE, 7, seed=0, device=device, spread=1.0)
    gs = case.experts.w13_input_gs
    logits, bias = _logits_and_bias(7, SHAPE[0], DEEPSEEK_V3, 0, device)
    xq, xsf = fp4_quantize(case.x, gs, is_sf_swizzled_layout=False)
    kw = dict(routing_logits=logits, routing_bias=bias, hidden_states=xq,
              hidden_states_scale=xsf.view(torch.float8_e4m3fn).flatten(), gemm1_bias=None,
              gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None, gemm2_bias=None,
              num_experts=SHAPE[0], top_k=4, n_group=4, topk_group=2,
              intermediate_size=SHAPE[2], local_expert_offset=0, local_num_experts=SHAPE[0],
              routed_scaling_factor=None, routing_method_type=DEEPSEEK_V3,
              **to_trtllm_inputs(case.experts, a1_gs=gs))
    return case, kw


REFUSALS = {
    # name: (kwargs override, exception)
    "default_routing": (dict(routing_method_type=0, n_group=None, topk_group=None), RuntimeError),
    "llama4_routing": (dict(routing_method_type=3, n_group=None, topk_group=None, top_k=1),
                       NotImplementedError),
    "deepseek_bf16_logits": ("bf16_logits", NotImplementedError),
    "deepseek_without_bias": (dict(routing_bias=None), NotImplementedError),
    "renormalize_fp32_logits": (dict(routing_method_type=1, n_group=None, topk_group=None,
                                     routing_bias=None), NotImplementedError),
    "bf16_hidden_states": ("bf16_x", RuntimeError),
    "swiglu_alpha": ("alpha", NotImplementedError),
    "geglu": (dict(gated_act_type=1), NotImplementedError),
    "no_finalize": (dict(do_finalize=False), NotImplementedError),
    "wrong_scalar_length": ("short_scalar", RuntimeError),
    "float_bias": ("fp32_bias", RuntimeError),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS))
def test_refuses_what_it_does_not_emulate(refusal, device):
    case, kw = _base_kwargs(device)
    change, exc = REFUSALS[refusal]
    # Reference check: the real kernel raises (RuntimeError) or would compute something the
    # emulator cannot reproduce (NotImplementedError); both must surface, never a result.
    assert torch.isfinite(trtllm_fp4_block_scale_moe(**kw)[0].float()).all()
    if change == "bf16_logits":
        kw["routing_logits"] = kw["routing_logits"].to(BF16)
    elif change == "bf16_x":
        kw["hidden_states"], kw["hidden_states_scale"] = case.x, None
    elif change == "alpha":
        kw["gemm1_alpha"] = torch.ones(SHAPE[0], device=device)
    elif change == "short_scalar":
        kw["output1_scale_scalar"] = kw["output1_scale_scalar"][:3]
    elif change == "fp32_bias":
        kw["routing_bias"] = kw["routing_bias"].float()
    else:
        kw.update(change)
    with pytest.raises(exc):
        trtllm_fp4_block_scale_moe(**kw)


def test_output_argument_is_written(device):
    _, kw = _base_kwargs(device)
    out = torch.full((7, SHAPE[1]), float("nan"), dtype=BF16, device=device)
    res = trtllm_fp4_block_scale_moe(**kw, output=out)
    # Reference check: FlashInfer returns [output] with the caller's tensor filled in.
    assert isinstance(res, list) and len(res) == 1 and res[0] is out
    assert torch.equal(out, trtllm_fp4_block_scale_moe(**kw)[0])
    with pytest.raises(RuntimeError):
        trtllm_fp4_block_scale_moe(**kw, output=torch.empty(7, SHAPE[1], device=device))



# ---------------------------------------------------------------------------------------------
# FlashInfer 0.7.x (what vLLM 0.34.0 calls): same numbers where the contracts agree, its own
# routing dtypes and methods where they do not.

SHAPE_07 = (16, 256, 128)  # the 0.7.4 docstring asks for intermediate_size % 128 == 0
DEFAULT = 0
ROUTINGS_07 = {
    # name: (routing, logits dtype, bias dtype or None)
    "default_fp32": ((DEFAULT, 2, None, None, None), torch.float32, None),
    "renormalize_fp32": ((RENORMALIZE, 2, None, None, None), torch.float32, None),
    "deepseek_v3_bf16_logits_fp32_bias": ((DEEPSEEK_V3, 4, 4, 2, 2.5), BF16, torch.float32),
    "deepseek_v3_ungrouped": ((DEEPSEEK_V3, 4, 0, 0, 1.0), torch.float32, torch.float32),
}


def _call_07(case, logits, bias, routing, gs, **kw):
    method, top_k, n_group, topk_group, rsf = routing
    xq, xsf = fp4_quantize(case.x, gs, is_sf_swizzled_layout=False)
    ex = case.experts
    return trtllm_fp4_block_scale_moe_0_7(
        logits, bias, xq, xsf.view(torch.float8_e4m3fn).reshape(xq.shape[0], -1),
        gemm1_bias=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None,
        gemm2_bias=None, num_experts=ex.num_experts, top_k=top_k, n_group=n_group,
        topk_group=topk_group, intermediate_size=ex.intermediate, local_expert_offset=0,
        local_num_experts=ex.num_experts, routed_scaling_factor=rsf, routing_method_type=method,
        **to_trtllm_inputs(ex, a1_gs=gs), **kw)[0]


@pytest.mark.parametrize("routing", sorted(ROUTINGS))
def test_0_7_gives_the_0_3_1_bits_on_vllm_0_11_calls(routing, device):
    case = make_case(*SHAPE, 64, seed=7, device=device, spread=1.0)
    gs = case.experts.w13_input_gs
    logits, bias = _logits_and_bias(64, SHAPE[0], ROUTINGS[routing][0], 7, device)
    old, _, _ = _call(case.x, case.experts, logits, bias, ROUTINGS[routing], a1_gs=gs)
    # Reference check: the 0.3.1 emulator; the +1e-20 in DeepSeek's denominator is below
    # fp32 resolution of a sum near 1, everything else is the same contract.
    assert torch.equal(_call_07(case, logits, bias, ROUTINGS[routing], gs), old)


@pytest.mark.parametrize("routing", sorted(ROUTINGS_07))
def test_0_7_routing_and_agreement(routing, device):
    (method, top_k, n_group, topk_group, rsf), ldt, bdt = ROUTINGS_07[routing]
    case = make_case(*SHAPE_07, 64, seed=8, device=device, spread=1.0)
    gs, ex = case.experts.w13_input_gs, case.experts
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(64, ex.num_experts, generator=gen).to(ldt).to(device)
    bias = None if bdt is None else (torch.randn(ex.num_experts, generator=gen) * 0.2).to(
        bdt).to(device)
    ids, w = route(logits, bias, routing_method_type=method, top_k=top_k, n_group=n_group,
                   topk_group=topk_group, routed_scaling_factor=rsf, contract="0.7")
    x = logits.float()
    if method == DEFAULT:
        want_w, want_ids = torch.topk(torch.softmax(x, -1), top_k, dim=-1)
    elif method == RENORMALIZE:
        want_ids, want_w = _renormalize_reference(logits, top_k)
    else:
        fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")
        grouped = getattr(fused_moe.grouped_topk, "_torchdynamo_orig_callable",
                          fused_moe.grouped_topk)
        b = bias.to(BF16).float() if n_group > 1 else bias.float()  # what 0.7 reads
        want_w, want_ids = grouped(x, x, top_k, True, max(n_group, 1), max(topk_group, 1),
                                   "sigmoid", rsf, b)
    # Reference check: the model-side routing (softmax->topk, topk->softmax, vLLM's
    # grouped_topk) -- same experts, weights within one bf16 rounding; then the ideal oracle.
    order, want_order = ids.long().sort(dim=-1), want_ids.long().sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    assert torch.allclose(w.float().gather(1, order.indices),
                          want_w.float().gather(1, want_order.indices), rtol=2 ** -8, atol=0)
    replay = torch.full((70, top_k), -1, dtype=torch.int16, device=device)
    out = _call_07(case, logits, bias, (method, top_k, n_group, topk_group, rsf), gs,
                   routing_replay_out=replay)
    assert torch.equal(replay[:64], ids.to(torch.int16)) and bool((replay[64:] == -1).all())
    ref = moe_reference_nvfp4(case.x, ex, w.float(), ids, a1_gs=gs)
    err = rel_err(out, ref)
    print(f"\n[trtllm-0.7] {routing}: {err:.2e}")
    assert 0.0 < err <= IDEAL_BOUND


REFUSALS_07 = {
    "swizzled_scale_layout": dict(hidden_states_scale_layout=0),
    "per_token_scale": "per_token_scale",
    "fused_shared_experts": dict(num_fused_shared_experts=1),
    "valid_hidden_size": dict(valid_hidden_size=64),
    "sigmoid_renorm_routing": dict(routing_method_type=6, n_group=None, topk_group=None),
    "relu2": dict(activation_type=6),
    "ungrouped_deepseek_without_bias": dict(n_group=0, topk_group=0, routing_bias=None),
    "nvfp4_4over6": dict(nvfp4_4over6=object()),
}


@pytest.mark.parametrize("refusal", sorted(REFUSALS_07))
def test_0_7_refuses_what_it_does_not_emulate(refusal, device):
    case, kw = _base_kwargs(device)
    kw.pop("routing_method_type")
    kw = dict(kw, routing_method_type=DEEPSEEK_V3, hidden_states_scale_layout=2)
    # Reference check: accepted as given; each change is one the emulator cannot reproduce
    # (FlashInfer itself raises NotImplementedError for a declared swizzled layout).
    assert torch.isfinite(trtllm_fp4_block_scale_moe_0_7(**kw)[0].float()).all()
    change = REFUSALS_07[refusal]
    if change == "per_token_scale":
        change = dict(per_token_scale=torch.ones(7, device=device))
    with pytest.raises(NotImplementedError):
        trtllm_fp4_block_scale_moe_0_7(**dict(kw, **change))


@pytest.mark.parametrize("weights_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("ep", [(1, 0), (2, 1)])
def test_0_7_routed_entry_point_is_the_kernel_with_routing_handed_in(weights_dtype, ep, device):
    """``trtllm_fp4_block_scale_routed_moe`` (what vLLM 0.34.0's modular TRT-LLM experts call):
    fed the kernel's own routing as ``(ids, weights)`` it gives the unrouted kernel's bits when
    the weights are bf16 (what the routing kernel writes); fp32 weights are read as fp32; the
    packed ``(id << 16) | bf16 bits`` form is the same call; with an EP slice only the local
    experts contribute."""
    case = make_case(*SHAPE_07, 64, seed=9, device=device, spread=1.0)
    gs, ex = case.experts.w13_input_gs, case.experts
    logits, bias = _logits_and_bias(64, ex.num_experts, RENORMALIZE, 9, device)
    ids, w = route(logits.to(BF16), None, routing_method_type=RENORMALIZE, top_k=4, n_group=None,
                   topk_group=None, routed_scaling_factor=None, contract="0.7")
    size, rank = ep
    e_local = ex.num_experts // size
    xq, xsf = fp4_quantize(case.x, gs, is_sf_swizzled_layout=False)
    inputs = to_trtllm_inputs(ex, a1_gs=gs)
    for k in ("gemm1_weights", "gemm1_weights_scale", "gemm2_weights", "gemm2_weights_scale",
              "output1_scale_scalar", "output1_scale_gate_scalar", "output2_scale_scalar"):
        inputs[k] = inputs[k][rank * e_local:(rank + 1) * e_local].contiguous()
    common = dict(
        routing_bias=None, hidden_states=xq,
        hidden_states_scale=xsf.view(torch.float8_e4m3fn).reshape(xq.shape[0], -1),
        gemm1_bias=None, gemm1_alpha=None, gemm1_beta=None, gemm1_clamp_limit=None,
        gemm2_bias=None, num_experts=ex.num_experts, top_k=4, n_group=0, topk_group=0,
        intermediate_size=ex.intermediate, local_expert_offset=rank * e_local,
        local_num_experts=e_local, routed_scaling_factor=None, **inputs)
    routed = trtllm_fp4_block_scale_routed_moe_0_7(
        (ids.to(torch.int32), w.to(weights_dtype)), routing_method_type=1, **common)[0]
    kernel = trtllm_fp4_block_scale_moe_0_7(logits.to(BF16), routing_method_type=RENORMALIZE,
                                            **common)[0]
    if weights_dtype == BF16:
        assert torch.equal(routed, kernel)
        packed = (ids.to(torch.int32) << 16) | (
            w.to(BF16).view(torch.int16).to(torch.int32) & 0xFFFF)
        assert torch.equal(trtllm_fp4_block_scale_routed_moe_0_7(
            packed, routing_method_type=1, **common)[0], routed)
    mine = (ids >= rank * e_local) & (ids < (rank + 1) * e_local)
    ref = moe_reference_nvfp4(case.x, ex, torch.where(mine, w.to(weights_dtype).float(),
                                                      torch.zeros_like(w.float())), ids, a1_gs=gs)
    assert rel_err(routed, ref) <= IDEAL_BOUND
    with pytest.raises(NotImplementedError, match="lora"):
        trtllm_fp4_block_scale_routed_moe_0_7((ids.to(torch.int32), w), routing_method_type=1,
                                              gemm1_lora_delta=torch.zeros(1), **common)
