# SPDX-License-Identifier: Apache-2.0
"""128x4 swizzled block-scale layout: round trips, padding, offsets, block_scale_interleave."""

import pytest
import torch

from fp4_moe_lab.nvfp4 import (
    block_scale_interleave,
    sf_offset_128x4,
    swizzle_128x4,
    unswizzle_128x4,
)

SEED = 0
ROWS = [1, 7, 130, 300]
SCALE_COLS = [3, 5, 8]
BATCH = [None, 3]
# nvmath-python's documented example: an NVFP4 (128, 128) tensor has K/16 = 8 scale columns;
# block (5, 2) lives at byte 82 and block (5, 5) at byte 593.
NVMATH_OFFSETS = [((5, 2), 82), ((5, 5), 593)]


def _round_up(x, m):
    return (x + m - 1) // m * m


def _random_sf(shape, device):
    gen = torch.Generator().manual_seed(SEED)
    # Nonzero bytes 1..126 are finite positive e4m3 values; zero is reserved for padding checks.
    return torch.randint(1, 127, shape, generator=gen, dtype=torch.uint8).to(device)


@pytest.mark.parametrize("batch", BATCH)
@pytest.mark.parametrize("ks", SCALE_COLS)
@pytest.mark.parametrize("m", ROWS)
def test_swizzle_round_trip_with_padding(m, ks, batch, device):
    shape = (m, ks) if batch is None else (batch, m, ks)
    sf = _random_sf(shape, device).view(torch.float8_e4m3fn)
    swz = swizzle_128x4(sf)
    mp, kp = _round_up(m, 128), _round_up(ks, 4)
    assert swz.dtype == sf.dtype and swz.device == sf.device
    assert swz.shape == ((mp, kp) if batch is None else (batch, mp, kp))
    raw = swz.view(torch.uint8)
    # Padding is zero and every original byte appears exactly once.
    assert int((raw != 0).sum()) == sf.numel()
    assert torch.equal(unswizzle_128x4(swz, m, ks).view(torch.uint8), sf.view(torch.uint8))
    # A flat buffer (what block_scale_interleave returns) unswizzles the same way.
    flat = unswizzle_128x4(raw.reshape(-1), m, ks)
    assert torch.equal(flat.reshape(shape), sf.view(torch.uint8))


@pytest.mark.parametrize("ks", SCALE_COLS)
@pytest.mark.parametrize("m", ROWS)
def test_offset_formula_matches_swizzle(m, ks, device):
    sf = _random_sf((2, m, ks), device)
    flat = swizzle_128x4(sf).reshape(-1).cpu()
    src = sf.cpu()
    # Reference check: the kernel's get_sf_out_offset_128x4 formula, element by element.
    for b in range(2):
        for r in range(m):
            for k in range(ks):
                off = sf_offset_128x4(r, k, ks, m_total=m, batch=b)
                assert flat[off] == src[b, r, k]


@pytest.mark.parametrize("block,offset", NVMATH_OFFSETS)
def test_nvmath_example_offsets(block, offset, device):
    m, ks = 128, 8
    assert sf_offset_128x4(*block, ks) == offset
    sf = torch.zeros((m, ks), dtype=torch.uint8, device=device)
    sf[block] = 77
    swz = swizzle_128x4(sf).reshape(-1)
    assert torch.nonzero(swz).flatten().tolist() == [offset]


def test_matches_reference_permutation(device):
    # Reference check: the reshape/permute of docs/NVFP4-FORMAT.md §3.4 written out independently.
    m, ks = 200, 12
    sf = _random_sf((m, ks), device)
    mp, kp = 256, 12
    pad = torch.zeros((mp, kp), dtype=torch.uint8, device=device)
    pad[:m, :ks] = sf
    want = pad.reshape(mp // 128, 4, 32, kp // 4, 4).permute(0, 3, 2, 1, 4).reshape(mp, kp)
    assert torch.equal(swizzle_128x4(sf), want)


@pytest.mark.parametrize("batch", BATCH)
def test_block_scale_interleave_contract(batch, device):
    m, ks = 130, 5
    shape = (m, ks) if batch is None else (batch, m, ks)
    sf = _random_sf(shape, device)
    out = block_scale_interleave(sf)
    # FlashInfer 0.3.1: 1-D uint8 of E * pad(rows, 128) * pad(cols, 4) bytes.
    assert out.dtype == torch.uint8 and out.dim() == 1
    assert out.numel() == (batch or 1) * 256 * 8
    assert torch.equal(out, swizzle_128x4(sf).reshape(-1))
    with pytest.raises(AssertionError):
        block_scale_interleave(sf.view(torch.float8_e4m3fn))


def test_unswizzle_rejects_wrong_size(device):
    with pytest.raises(ValueError):
        unswizzle_128x4(torch.zeros(100, dtype=torch.uint8, device=device), 7, 3)
