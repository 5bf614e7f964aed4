# SPDX-License-Identifier: Apache-2.0
"""The prepare/finalize and experts subclasses, on vLLM 0.11.0's real classes (in-process)."""

import pytest
import torch

M, H, I, E = 5, 256, 256, 4  # noqa: E741 (I: the MoE intermediate size, next to M, H, E)


def _quant_config():
    from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

    return nvfp4_moe_quant_config(
        g1_alphas=torch.ones(E), g2_alphas=torch.ones(E), a1_gscale=torch.arange(1.0, E + 1),
        a2_gscale=torch.ones(E), w1_scale=torch.ones(E, 2 * I, H // 16, dtype=torch.float8_e4m3fn),
        w2_scale=torch.ones(E, H, I // 16, dtype=torch.float8_e4m3fn))


def test_workspace_output_shape_for_bf16_input():
    from vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe import FlashInferExperts

    from vllm_fp4_moe_plugin.patches.init_prepare_finalize.flashinfer_cutlass import (
        KernelOutputShapeFlashInferExperts,
    )

    a = torch.zeros(M, H, dtype=torch.bfloat16)
    packed = torch.zeros(3 * M, H // 2, dtype=torch.uint8)  # e.g. after a DP all-gather
    cfg = _quant_config()
    stock = FlashInferExperts(out_dtype=torch.bfloat16, quant_config=cfg)
    fixed = KernelOutputShapeFlashInferExperts(out_dtype=torch.bfloat16, quant_config=cfg)
    args = (M, 2 * I, H // 2, 2, E, E, None)
    # Reference check: the kernel writes (tokens, hidden) whatever the input dtype.
    assert stock.workspace_shapes(a, a, *args)[2] == (M, 2 * H)  # the stock bug for bf16 input
    assert fixed.workspace_shapes(a, a, *args)[2] == (M, H)
    assert fixed.workspace_shapes(a, packed, *args)[2] == (3 * M, H)
    assert stock.workspace_shapes(a, packed, *args)[2] == (3 * M, H)


def test_non_dp_prepare_passes_bf16_through():
    from vllm_fp4_moe_plugin.patches.init_prepare_finalize.flashinfer_cutlass import (
        KernelQuantizedPrepareAndFinalize,
    )

    a1 = torch.randn(M, H).to(torch.bfloat16)
    ids = torch.zeros(M, 1, dtype=torch.int32)
    w = torch.full((M, 1), 0.5)
    out = KernelQuantizedPrepareAndFinalize(use_dp=False).prepare(
        a1.clone(), w, ids, E, None, False, _quant_config())
    assert torch.equal(out[0], a1) and out[1] is None and out[2] is None
    scaled = KernelQuantizedPrepareAndFinalize(use_dp=False).prepare(
        a1.clone(), w, ids, E, None, True, _quant_config())
    torch.testing.assert_close(scaled[0], (a1.float() * 0.5).to(torch.bfloat16))


def test_stock_prepare_quantizes_before_the_kernel():
    """The behaviour the fix removes: stock calls fp4_quantize in prepare (CPU: it raises)."""
    from vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize import (
        FlashInferAllGatherMoEPrepareAndFinalize,
    )

    a1 = torch.randn(M, H).to(torch.bfloat16)
    with pytest.raises(Exception):  # noqa: B017 (any error: the point is that prepare calls it)
        FlashInferAllGatherMoEPrepareAndFinalize(use_dp=False).prepare(
            a1, torch.ones(M, 1), torch.zeros(M, 1, dtype=torch.int32), E, None, False,
            _quant_config())
