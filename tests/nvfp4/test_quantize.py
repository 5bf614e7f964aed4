# SPDX-License-Identifier: Apache-2.0
"""quantize / dequantize: scales, zero blocks, saturation, broadcasting of the global scale."""

import pytest
import torch

from fp4_moe_lab.nvfp4 import (
    BLOCK_SIZE,
    E4M3_MAX,
    FP4_MAX,
    dequantize,
    e2m1_decode,
    global_scale,
    quantize,
    quantize_codes,
    random_master,
    unpack_fp4,
)

SEED = 0
CONVENTIONS = ["flashinfer", "compressed_tensors"]
SHAPES = [(1, 32), (7, 64), (64, 256)]
# Per-element dequantization error bound: half an E2M1 step at the element's magnitude. The
# largest step is 2 (between 4 and 6), so |x - x_hat| <= 1 * sf / gs; E4M3 rounding of the block
# scale can move the grid by at most 1/16 relative, which the bound below allows for.
HALF_STEP_SLACK = 1.0 + 1.0 / 16


def _case(shape, device, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    return random_master(shape, gen=gen, std=1.0, outlier_factor=50.0).to(device)


def test_global_scale_formula(device):
    amax = torch.tensor([1.0, 448.0, 2688.0, 7.0], device=device)
    g = global_scale(amax)
    assert g.dtype == torch.float32 and g.device == amax.device
    # Reference check: torch's `2688.0 / t` == reciprocal(t) * 2688 (CT generate_gparam's form).
    assert torch.equal(g, torch.reciprocal(amax) * 2688.0)
    assert g[0] == 2688.0 and g[2] == 1.0
    assert float(global_scale(2688.0)) == 1.0


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_shapes_dtypes_and_zero_block(convention, shape, device):
    x = _case(shape, device)
    zero = x.float().reshape(-1, BLOCK_SIZE).abs().amax(-1) == 0
    assert int(zero.sum()) == 1  # random_master plants exactly one all-zero block
    gs = global_scale(x.float().abs().max())
    packed, sf = quantize(x, gs, convention=convention)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    assert sf.dtype == torch.float8_e4m3fn and sf.shape == (*shape[:-1], shape[-1] // 16)
    assert packed.device == x.device and sf.device == x.device
    # Zero block: scale 0 and codes 0 (what the kernels write; CT would store 0.125).
    assert torch.equal(sf.float().reshape(-1) == 0, zero)
    assert torch.all(unpack_fp4(packed).reshape(-1, BLOCK_SIZE)[zero] == 0)


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_block_scale_maps_block_max_to_six(convention, shape, device):
    x = _case(shape, device)
    gs = global_scale(x.float().abs().max())
    _, sf = quantize(x, gs, convention=convention)
    amax = x.float().reshape(*shape[:-1], -1, BLOCK_SIZE).abs().amax(-1)
    # Reference check: sf = e4m3(gs * amax / 6), computed here in fp64 and rounded once.
    want = (gs.double() * amax.double() / FP4_MAX).clamp(max=E4M3_MAX).float()
    want = want.to(torch.float8_e4m3fn).float()
    assert torch.equal(sf.float(), want)
    # The tensor's largest block is exactly at the top of the E4M3 range.
    assert float(sf.float().max()) == E4M3_MAX


@pytest.mark.parametrize("convention", CONVENTIONS)
@pytest.mark.parametrize("shape", SHAPES)
def test_dequant_error_within_half_step(convention, shape, device):
    x = _case(shape, device)
    gs = global_scale(x.float().abs().max())
    packed, sf = quantize(x, gs, convention=convention)
    xh = dequantize(packed, sf, gs)
    assert xh.dtype == torch.float32
    err = (xh - x.float()).reshape(*shape[:-1], -1, BLOCK_SIZE).abs()
    step_scale = (sf.float() / gs).unsqueeze(-1)
    # Reference check: no element is further than ~half the largest E2M1 step from its value.
    assert torch.all(err <= HALF_STEP_SLACK * step_scale + 1e-12)
    rel = float((xh - x.float()).norm() / x.float().norm())
    assert 0.0 < rel < 0.15  # FP4 noise: measured 0.068-0.100 (5 seeds x these shapes)


def test_saturation_when_global_scale_too_large(device):
    x = _case((4, 64), device)
    gs = global_scale(x.float().abs().max()) * 8  # amax 8x underestimated
    codes, sf = quantize_codes(x, gs)
    assert float(sf.float().max()) == E4M3_MAX  # clamped, not NaN
    assert torch.isfinite(sf.float()).all()
    assert int((codes & 7).max()) == 7  # some elements saturate at +-6


@pytest.mark.parametrize("convention", CONVENTIONS)
def test_per_row_and_per_expert_scales(convention, device):
    x = _case((3, 5, 64), device)
    gs = global_scale(x.float().abs().reshape(3, -1).amax(1)).to(device)  # per expert [E]
    packed, sf = quantize(x, gs.reshape(3, 1), convention=convention)
    # Reference check: quantizing each expert alone with its scalar gives the same bytes.
    for e in range(3):
        pe, se = quantize(x[e], gs[e], convention=convention)
        assert torch.equal(packed[e], pe)
        assert torch.equal(sf[e].view(torch.uint8), se.view(torch.uint8))
    rows = global_scale(x[0].float().abs().amax(1))
    pr, sr = quantize(x[0], rows, convention=convention)
    for r in range(5):
        assert torch.equal(pr[r], quantize(x[0, r], rows[r], convention=convention)[0])
    with pytest.raises(ValueError):
        quantize(x, gs, convention=convention)  # [3] does not broadcast to (3, 5)


def test_rejects_bad_arguments(device):
    x = _case((2, 32), device)
    with pytest.raises(ValueError):
        quantize(x, 1.0, convention="modelopt")
    with pytest.raises(ValueError):
        quantize(x[:, :24], 1.0)


def test_codes_decode_to_scaled_values(device):
    x = _case((8, 128), device)
    gs = global_scale(x.float().abs().max())
    codes, sf = quantize_codes(x, gs)
    vals = e2m1_decode(codes)
    # Reference check: |decoded code| <= 6 and the sign matches x wherever the code is nonzero.
    assert float(vals.abs().max()) == 6.0
    nz = vals != 0
    assert torch.equal(torch.sign(vals[nz]), torch.sign(x.float()[nz]))
