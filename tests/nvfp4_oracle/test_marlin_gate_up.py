# SPDX-License-Identifier: Apache-2.0
"""Split gate/up weight scales on vLLM 0.34.0's weight-only path (Marlin, W4A16: Hopper, or
--moe-backend marlin). The oracle's real ``convert_to_nvfp4_moe_kernel_format`` runs its Marlin
branch; Marlin's helper itself repacks for a CUDA kernel, so a recording stand-in takes its
place and shows what the kernel would be given: the gate's scale for GEMM1 and, with the plugin,
GEMM2's weight scale over each expert's factor (the carry; nothing else changes)."""

from types import SimpleNamespace

import pytest
import torch

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.patches import ledger

GATE = torch.tensor([0.5, 0.25, 1.0, 2.0])
UP_OVER_GATE = torch.tensor([1.0, 4.0, 0.25, 8.0])


def _layer(up_over_gate):
    """A ModelOpt NVFP4 MoE layer's loaded scales as the oracle sees them (dequantizing
    multipliers; gate and up per expert)."""
    return SimpleNamespace(layer_name="model.layers.1.mlp.experts", ep_size=1,
                           w13_weight_scale_2=torch.stack([GATE, GATE * up_over_gate], dim=1),
                           w13_input_scale=torch.ones(4, 2))


def _hand_to_marlin(monkeypatch, layer, plugin_on: bool) -> dict:
    oracle = pytest.importorskip(vm.NVFP4_ORACLE)
    handed = {}

    def marlin_stand_in(layer, w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2,
                        is_act_and_mul):
        handed.update(w13_scale_2=w13_scale_2, w2_scale_2=w2_scale_2)
        return w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2

    monkeypatch.setattr(oracle, vm.ORACLE_MARLIN_HELPER, marlin_stand_in)
    if plugin_on:
        ledger.apply_all()
    try:
        e, n, k = 4, 64, 128
        oracle.convert_to_nvfp4_moe_kernel_format(
            nvfp4_backend=oracle.NvFp4MoeBackend.MARLIN, layer=layer,
            w13=torch.zeros(e, 2 * n, k // 2, dtype=torch.uint8),
            w13_scale=torch.ones(e, 2 * n, k // 16).to(torch.float8_e4m3fn),
            w13_scale_2=layer.w13_weight_scale_2[:, 0].contiguous(), a13_scale=torch.ones(e),
            w2=torch.zeros(e, k, n // 2, dtype=torch.uint8),
            w2_scale=torch.ones(e, k, n // 16).to(torch.float8_e4m3fn),
            w2_scale_2=torch.full((e,), 0.125), a2_scale=torch.ones(e), is_act_and_mul=True)
    finally:
        ledger.revert_all()
    return handed


def test_the_ledger_wraps_the_weight_only_helper_here():
    assert f"{vm.NVFP4_ORACLE}.{vm.ORACLE_MARLIN_HELPER}" in ledger.plan().patches


@pytest.mark.parametrize("plugin_on", [False, True])
def test_marlin_gets_gemm2_scales_that_carry_the_up_half(monkeypatch, fresh_plugin, plugin_on):
    handed = _hand_to_marlin(monkeypatch, _layer(UP_OVER_GATE), plugin_on)
    torch.testing.assert_close(handed["w13_scale_2"], GATE)  # vLLM's one scale: the gate's
    # the kernel dequantizes the up half with the gate's scale: r = 1 / UP_OVER_GATE times it
    expected = torch.full((4,), 0.125) * UP_OVER_GATE if plugin_on else torch.full((4,), 0.125)
    torch.testing.assert_close(handed["w2_scale_2"], expected)


def test_equal_halves_reach_marlin_unchanged(monkeypatch, fresh_plugin):
    handed = _hand_to_marlin(monkeypatch, _layer(torch.ones(4)), True)
    assert torch.equal(handed["w2_scale_2"], torch.full((4,), 0.125))
