# SPDX-License-Identifier: Apache-2.0
"""E2M1 rounding (RNE, saturating, signed zero) and nibble packing."""

import pytest
import torch

from fp4_moe_lab.nvfp4 import E2M1_VALUES, e2m1_decode, e2m1_round, pack_fp4, unpack_fp4

SEED = 0
# (input, expected value): every tie goes to the even mantissa, beyond 6 saturates.
TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]
NEAR = [(0.2500001, 0.5), (0.7499999, 0.5), (1.2500001, 1.5), (1.7499999, 1.5), (2.5000002, 3.0),
        (3.4999998, 3.0), (5.0000005, 6.0), (6.0, 6.0), (7.9, 6.0), (1e30, 6.0)]
SHAPES = [(1, 2), (3, 32), (2, 5, 64)]


def test_table_values(device):
    assert E2M1_VALUES.dtype == torch.float32 and E2M1_VALUES.shape == (16,)
    assert E2M1_VALUES[:8].tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert torch.equal(E2M1_VALUES[8:], -E2M1_VALUES[:8])
    assert torch.signbit(E2M1_VALUES[8])  # code 8 is -0.0
    decoded = e2m1_decode(torch.arange(16, device=device))
    assert decoded.device == device and torch.equal(decoded.cpu(), E2M1_VALUES)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_round_ties_and_saturation(sign, device):
    cases = TIES + NEAR
    x = torch.tensor([sign * v for v, _ in cases], dtype=torch.float32, device=device)
    got = e2m1_decode(e2m1_round(x))
    # Reference check: the hand-written RNE table above.
    want = torch.tensor([sign * w for _, w in cases], dtype=torch.float32, device=device)
    assert torch.equal(got, want)


def test_round_every_code_is_a_fixed_point(device):
    codes = torch.arange(16, dtype=torch.uint8, device=device)
    assert torch.equal(e2m1_round(e2m1_decode(codes)), codes)


def test_signed_zero_and_infinity(device):
    x = torch.tensor([-0.1, 0.1, -0.0, 0.0, float("inf"), -float("inf")], device=device)
    assert e2m1_round(x).tolist() == [8, 0, 8, 0, 7, 15]


@pytest.mark.parametrize("shape", SHAPES)
def test_round_is_nearest(shape, device):
    gen = torch.Generator().manual_seed(SEED)
    x = (torch.randn(shape, generator=gen) * 3).to(device)
    got = e2m1_decode(e2m1_round(x))
    # Reference check: brute force nearest over the 15 distinct values (clamped to +-6).
    cand = E2M1_VALUES.to(device)
    dist = (x.clamp(-6, 6).unsqueeze(-1) - cand).abs()
    best = dist.min(dim=-1).values
    assert torch.equal((x.clamp(-6, 6) - got).abs(), best)


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_unpack_round_trip(shape, device):
    gen = torch.Generator().manual_seed(SEED)
    codes = torch.randint(0, 16, shape, generator=gen, dtype=torch.uint8).to(device)
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    # Reference check: element 2i in the low nibble, 2i+1 in the high nibble.
    assert torch.equal(packed & 0xF, codes[..., 0::2])
    assert torch.equal(packed >> 4, codes[..., 1::2])
    assert torch.equal(unpack_fp4(packed), codes)


def test_pack_rejects_odd_length(device):
    with pytest.raises(ValueError):
        pack_fp4(torch.zeros(3, dtype=torch.uint8, device=device))
