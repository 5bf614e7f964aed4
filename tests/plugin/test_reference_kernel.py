# SPDX-License-Identifier: Apache-2.0
"""The engine reference kernel: ideal NVFP4 from kernel-format tensors, independent of the
emulator's code, must agree with the emulator on the plugin's (bf16, per-expert) path."""

import pytest
import torch

from fp4_moe_lab.nvfp4 import (
    cutlass_fused_moe,
    moe_reference_nvfp4,
    random_experts,
    to_flashinfer_inputs,
)
from fp4_moe_lab.simulation.reference_kernel import (
    SHADOW_NOISE_BOUND,
    experts_from_kernel_args,
    reference_cutlass_fused_moe,
    shadow_cutlass_fused_moe,
    shadow_records,
)

E, H, I, TOP_K, M = 8, 256, 256, 2, 24  # noqa: E741 (I: the MoE intermediate size, next to M, H, E)


@pytest.fixture(scope="module")
def case():
    experts = random_experts(E, H, I, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(M, H, generator=g).to(torch.bfloat16)
    probs = torch.softmax(torch.randn(M, E, generator=g), -1)
    w, ids = probs.topk(TOP_K, -1)
    return experts, x, (w / w.sum(-1, keepdim=True)).float(), ids.to(torch.int32)


def test_round_trip_of_kernel_args(case):
    experts = case[0]
    kw = to_flashinfer_inputs(experts, a1_gs=experts.w13_input_gs)
    back = experts_from_kernel_args(kw["fc1_expert_weights"], kw["fc2_expert_weights"],
                                    kw["quant_scales"])
    for name in ("w1", "w3", "w2"):
        assert torch.equal(getattr(back, name), getattr(experts, name))
        assert torch.equal(getattr(back, name + "_sf").view(torch.uint8),
                           getattr(experts, name + "_sf").view(torch.uint8))
    torch.testing.assert_close(back.w13_weight_gs, experts.w13_weight_gs, rtol=1e-6, atol=0)


@pytest.mark.parametrize("ep_size", [1, 2])
def test_matches_emulator_on_the_per_expert_path(case, ep_size):
    experts, x, w, ids = case
    local = E // ep_size
    total_ref = torch.zeros(M, H)
    total_emu = torch.zeros(M, H)
    for rank in range(ep_size):
        part = experts.experts_slice(rank * local, (rank + 1) * local)
        kw = to_flashinfer_inputs(part, a1_gs=part.w13_input_gs)
        args = dict(input=x, token_selected_experts=ids, token_final_scales=w,
                    output_dtype=torch.bfloat16, ep_size=ep_size, ep_rank=rank, **kw)
        total_ref += reference_cutlass_fused_moe(**args)[0].float()
        total_emu += cutlass_fused_moe(**args)[0].float()
    # Reference check: both are the ideal per-expert NVFP4 answer, rounded to bf16.
    ideal = moe_reference_nvfp4(x, experts, w, ids, a1_gs=experts.w13_input_gs,
                                intermediate_dtype=torch.bfloat16)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(total_ref, ideal) < 5e-3
    assert rel(total_ref, total_emu) < 5e-3


def test_refuses_prequantized_input(case):
    experts, x, w, ids = case
    kw = to_flashinfer_inputs(experts, a1_gs=experts.w13_input_gs)
    with pytest.raises(RuntimeError, match="bf16 input"):
        reference_cutlass_fused_moe(input=x.view(torch.uint8)[:, : H // 2].contiguous(),
                                    token_selected_experts=ids, token_final_scales=w,
                                    output_dtype=torch.bfloat16, **kw)


def _prequantized(x, gs):
    """What the NVFP4-oracle design hands FlashInfer CUTLASS: packed codes + swizzled SF."""
    from fp4_moe_lab.nvfp4 import fp4_quantize

    q, sf = fp4_quantize(x, gs, 16, False, True)
    return q, sf


@pytest.mark.parametrize("ep_size", [1, 2])
def test_prequantized_matches_emulator_and_ideal_with_one_shared_scale(case, ep_size):
    """The oracle seam's reference: pre-quantized input decoded with the kernel's own scalar
    GEMM1 scale = the ideal loop with that shared scale, and = the emulator given the same
    pre-quantized input."""
    from fp4_moe_lab.simulation.reference_kernel import (
        reference_cutlass_fused_moe_prequantized,
    )

    experts, x, w, ids = case
    gs = experts.w13_input_gs.min().reshape(())
    q, sf = _prequantized(x, gs)
    local = E // ep_size
    total_ref = torch.zeros(M, H)
    total_emu = torch.zeros(M, H)
    for rank in range(ep_size):
        part = experts.experts_slice(rank * local, (rank + 1) * local)
        kw = to_flashinfer_inputs(part, a1_gs=gs)
        args = dict(input=q, input_sf=sf, token_selected_experts=ids, token_final_scales=w,
                    output_dtype=torch.bfloat16, ep_size=ep_size, ep_rank=rank, **kw)
        total_ref += reference_cutlass_fused_moe_prequantized(**args)[0].float()
        total_emu += cutlass_fused_moe(**args)[0].float()
    ideal = moe_reference_nvfp4(x, experts, w, ids, a1_gs=gs, intermediate_dtype=torch.bfloat16)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(total_ref, ideal) < 5e-3
    assert rel(total_ref, total_emu) < 5e-3


def test_prequantized_sees_a_sender_with_another_scale(case):
    """Quantized with half the scale the kernel holds (a stock DP+EP sender whose local max is
    2x larger): the reference decodes with the kernel's scale and is off by 2x in GEMM1, like the
    kernel -- which is why the reference engine runs with the plugin on."""
    from fp4_moe_lab.simulation.reference_kernel import (
        reference_cutlass_fused_moe_prequantized,
    )

    experts, x, w, ids = case
    gs = experts.w13_input_gs.min().reshape(())
    kw = to_flashinfer_inputs(experts, a1_gs=gs)
    base = dict(token_selected_experts=ids, token_final_scales=w, output_dtype=torch.bfloat16,
                **kw)
    q, sf = _prequantized(x, gs)
    right = reference_cutlass_fused_moe_prequantized(input=q, input_sf=sf, **base)[0].float()
    q, sf = _prequantized(x, gs / 2)
    wrong = reference_cutlass_fused_moe_prequantized(input=q, input_sf=sf, **base)[0].float()
    assert float((wrong - right).norm() / right.norm()) > 0.1


def test_prequantized_refuses_per_expert_scales(case):
    from fp4_moe_lab.simulation.reference_kernel import (
        reference_cutlass_fused_moe_prequantized,
    )

    experts, x, w, ids = case
    kw = to_flashinfer_inputs(experts, a1_gs=experts.w13_input_gs)
    q, sf = _prequantized(x, experts.w13_input_gs.min().reshape(()))
    with pytest.raises(RuntimeError, match="per-expert GEMM1 scales"):
        reference_cutlass_fused_moe_prequantized(
            input=q, input_sf=sf, token_selected_experts=ids, token_final_scales=w,
            output_dtype=torch.bfloat16, **kw)


def _plugin_path_args(case):
    experts, x, w, ids = case
    kw = to_flashinfer_inputs(experts, a1_gs=experts.w13_input_gs)
    return dict(input=x, token_selected_experts=ids, token_final_scales=w,
                output_dtype=torch.bfloat16, **kw)


def test_shadow_returns_the_emulator_output_and_reports_noise(case, capfd):
    args = _plugin_path_args(case)
    out = shadow_cutlass_fused_moe(**args)[0]
    assert torch.equal(out, cutlass_fused_moe(**args)[0])
    (record,) = shadow_records(capfd.readouterr().err)
    assert record["rows"] == M and record["rel_err"] <= SHADOW_NOISE_BOUND


def test_shadow_reports_an_emulator_that_ignores_per_expert_scales(case, capfd, monkeypatch):
    """The failure the shadow exists to see: a kernel that quantizes every expert's input with
    expert 0's scale while its alphas stay per expert (the stock 0.11.0 mismatch)."""
    import fp4_moe_lab.nvfp4 as nvfp4

    def first_scale_only(**kw):
        a1, *rest = kw["quant_scales"]
        return cutlass_fused_moe(**{**kw, "quant_scales": [a1[:1].expand_as(a1), *rest]})

    monkeypatch.setattr(nvfp4, "cutlass_fused_moe", first_scale_only)
    shadow_cutlass_fused_moe(**_plugin_path_args(case))
    (record,) = shadow_records(capfd.readouterr().err)
    assert record["rel_err"] > 0.5, record  # measured 2.9; noise 0.0
