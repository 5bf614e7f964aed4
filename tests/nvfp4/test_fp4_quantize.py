# SPDX-License-Identifier: Apache-2.0
"""fp4_quantize: FlashInfer 0.3.1's return contract and its element-0-only global scale."""

import pytest
import torch

from fp4_moe_lab.nvfp4 import (
    dequantize,
    fp4_quantize,
    global_scale,
    quantize,
    random_master,
    swizzle_128x4,
    unswizzle_128x4,
)

SEED = 0
DTYPES = [torch.bfloat16, torch.float16]
ROWS = [1, 7, 64]
HIDDEN = [64, 256]
SCALE_SPREAD = [0.25, 4.0]  # vec[1] / vec[0]
# Dequantized relative Frobenius error of FP4 with a proper global scale: measured 0.07-0.10
# on these inputs (test_quantize.py); 0.15 leaves margin.
ROUND_TRIP_BOUND = 0.15


def _x(m, k, dtype, device):
    gen = torch.Generator().manual_seed(SEED)
    return random_master((m, k), gen=gen, std=1.0, outlier_factor=50.0).to(dtype).to(device)


@pytest.mark.parametrize("swizzled", [True, False])
@pytest.mark.parametrize("k", HIDDEN)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_shapes_and_dtypes(dtype, m, k, swizzled, device):
    x = _x(m, k, dtype, device)
    gs = global_scale(x.float().abs().max()).reshape(1)
    xq, sf = fp4_quantize(x, gs, is_sf_swizzled_layout=swizzled)
    assert xq.dtype == torch.uint8 and xq.shape == (m, k // 2)
    assert sf.dtype == torch.uint8 and xq.device == x.device and sf.device == x.device
    ks = k // 16
    # Swizzled: pad(m,128) * pad(ks,4) bytes, reshaped to (-1, ks); linear: (m, ks).
    assert sf.shape == ((((m + 127) // 128) * 128, ks) if swizzled else (m, ks))
    # Reference check: same bits as the linear quantizer (+ the 128x4 swizzle).
    packed, lin = quantize(x, gs, convention="flashinfer")
    assert torch.equal(xq, packed)
    want = swizzle_128x4(lin.view(torch.uint8)) if swizzled else lin.view(torch.uint8)
    assert torch.equal(sf, want.reshape(sf.shape))


def test_leading_dims_and_column_major(device):
    x = _x(12, 64, torch.bfloat16, device).reshape(3, 4, 64)
    gs = global_scale(x.float().abs().max()).reshape(1)
    xq, sf = fp4_quantize(x, gs, is_sf_swizzled_layout=False)
    assert xq.shape == (3, 4, 32) and sf.shape == (12, 4)
    # Column-major 2-D input: the wrapper transposes, quantizes rows, transposes both back.
    col = _x(64, 32, torch.bfloat16, device).t().contiguous().t()  # shape (64, 32), stride (1, 64)
    assert col.stride(-2) == 1
    cq, csf = fp4_quantize(col, gs, is_sf_swizzled_layout=False)
    rq, rsf = fp4_quantize(col.t().contiguous(), gs, is_sf_swizzled_layout=False)
    assert torch.equal(cq, rq.t()) and torch.equal(csf, rsf.t())


@pytest.mark.parametrize("spread", SCALE_SPREAD)
@pytest.mark.parametrize("m", ROWS)
def test_vector_global_scale_uses_element_zero_only(m, spread, device):
    x = _x(m, 256, torch.bfloat16, device)
    g0 = float(global_scale(x.float().abs().max()))
    vec = torch.tensor([g0, g0 * spread, g0 * 2.0, g0 / 3.0], dtype=torch.float32, device=device)
    q_vec, sf_vec = fp4_quantize(x, vec)
    q_first, sf_first = fp4_quantize(x, vec[:1])
    q_e1, sf_e1 = fp4_quantize(x, vec[1:2])
    # Reference check: the kernel reads SFScale[0] (FlashInfer quantization.cuh:763).
    assert torch.equal(q_vec, q_first) and torch.equal(sf_vec, sf_first)
    assert not torch.equal(sf_vec, sf_e1)  # another element would have changed the scales
    q_0d, sf_0d = fp4_quantize(x, vec[0])  # a 0-dim tensor is the same single value
    assert torch.equal(q_0d, q_first) and torch.equal(sf_0d, sf_first)


@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequant_round_trip(dtype, m, device):
    x = _x(m, 256, dtype, device)
    gs = global_scale(x.float().abs().max()).reshape(1)
    xq, sf = fp4_quantize(x, gs)
    lin = unswizzle_128x4(sf, m, 16).view(torch.float8_e4m3fn)
    xh = dequantize(xq, lin, gs)
    rel = float((xh - x.float()).norm() / x.float().norm())
    # Reference check: NVFP4 round-trip noise, not zero (it is lossy) and not larger.
    assert 0.0 < rel < ROUND_TRIP_BOUND


def test_unsupported_modes_raise(device):
    x = _x(4, 64, torch.bfloat16, device)
    gs = torch.ones(1, device=device)
    with pytest.raises(NotImplementedError):
        fp4_quantize(x, gs, sf_vec_size=32, sf_use_ue8m0=True)
    with pytest.raises(NotImplementedError):
        fp4_quantize(x, gs, is_sf_8x4_layout=True)
    with pytest.raises(NotImplementedError):
        fp4_quantize(x, gs, sf_vec_size=8)
    with pytest.raises(NotImplementedError):
        fp4_quantize(x.float(), gs)
    with pytest.raises(RuntimeError):
        fp4_quantize(x, None)
    with pytest.raises(RuntimeError):
        fp4_quantize(x, gs.double())
    # K/16 = 3 is not a multiple of 4: the real wrapper's reshape((-1, K/16)) fails too.
    with pytest.raises(RuntimeError):
        fp4_quantize(_x(4, 48, torch.bfloat16, device), gs)
