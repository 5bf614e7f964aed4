# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.34.0's TRT-LLM NVFP4 weight layout, built with FlashInfer 0.7's OWN shuffle helpers,
undone bit for bit by the emulator's unshuffle. (On vLLM 0.20.0 the same checks run with the
helpers of its pin, FlashInfer 0.6.8.post1, whose wheel has no 128x4 reader: see
flashinfer_wheel.py.)

vLLM prepares the TRT-LLM weights in ``prepare_static_weights_for_trtllm_fp4_moe``
(Q/utils/flashinfer_fp4_moe.py:327-441, Q = vllm/model_executor/layers/quantization): per
expert, GEMM1's ``[w3; w1]`` rows and block-scale rows are gathered with
``flashinfer.fused_moe.core._maybe_get_cached_w3_w1_permute_indices`` (gated-activation
interleave chained with the 32-row ``shuffle_matrix_a`` permutation), GEMM2's with
``get_w2_permute_indices_with_cache``, both at ``epilogue_tile_m = 128`` (:345), and each
scale matrix goes through ``flashinfer.nvfp4_block_scale_interleave`` (the 128x4 layout).

In the matrix (simulation/oracle_trtllm.py) those three FlashInfer names are the seam's CPU
stand-ins, and the emulator reads the result back with ``nvfp4.trtllm_layout.unshuffle_gemm1``/
``unshuffle_gemm2``. Here vLLM's own function runs once with FlashInfer 0.7.x's helpers, executed
from the released wheel (tests/nvfp4_oracle/flashinfer_wheel.py: 0.7.3, vLLM's pin, is not on the
package index; 0.7.2.post1 and 0.7.4 bracket it), and once with the seam's stand-ins. Only
``nvfp4_block_scale_interleave`` cannot be FlashInfer's on CPU (an SM100 JIT module): the
project's mirror stands in for it both times, and FlashInfer 0.7's own pure-torch reader of the
128x4 layout (``trace/templates/gemm.py`` ``_unswizzle_batched_sf_128x4``) checks what it wrote.
"""

import inspect
import re
import sys
import types

import pytest
import torch

from fp4_moe_lab import nvfp4
from fp4_moe_lab.nvfp4 import trtllm_layout
from fp4_moe_lab.simulation import oracle_trtllm

from . import flashinfer_wheel

_FP4 = "vllm.model_executor.layers.quantization.utils.flashinfer_fp4_moe"
E, H = 3, 256  # hidden as in the matrix's Scenario
# GEMM1/GEMM2 intermediate size: the matrix's Scenario (512) and one TP=2 rank of it.
INTERMEDIATES = [512, 256]
WHEELS = flashinfer_wheel.wheels()


@pytest.fixture(scope="module", params=WHEELS or [None],
                ids=lambda w: w.name.split("-")[1] if w else "no-wheel")
def fi(request):
    """The helpers of one wheel of the FlashInfer series the installed vLLM pins (0.7.x for
    0.34.0, 0.6.x for 0.20.0; flashinfer_wheel.py); a missing wheel is a failure, not a skip:
    ``scripts/bootstrap-release.sh 0.34.0`` puts the 0.7.x ones in place."""
    if request.param is None:
        pytest.fail(f"no {flashinfer_wheel.pattern()} in {flashinfer_wheel.wheel_dir()} "
                    f"(vLLM pins flashinfer-python=={flashinfer_wheel.pinned()}; "
                    "scripts/bootstrap-release.sh 0.34.0 downloads 0.7.x, else "
                    "pip download --no-deps -d that folder)")
    return flashinfer_wheel.load(request.param,
                                 {"block_scale_interleave": nvfp4.block_scale_interleave})


def _flashinfer_07(fi) -> dict:
    """The ``flashinfer`` names vLLM's preparation imports (:338-342), as a module tree: the
    wheel's two permute-index helpers, and the project's 128x4 interleave (FlashInfer's needs
    an SM100 JIT module)."""
    fi_mod, fm, core = (types.ModuleType(n) for n in
                        ("flashinfer", "flashinfer.fused_moe", "flashinfer.fused_moe.core"))
    fi_mod.fused_moe, fm.core = fm, core
    fi_mod.nvfp4_block_scale_interleave = nvfp4.block_scale_interleave
    core._maybe_get_cached_w3_w1_permute_indices = fi._maybe_get_cached_w3_w1_permute_indices
    core.get_w2_permute_indices_with_cache = fi.get_w2_permute_indices_with_cache
    return {"flashinfer": fi_mod, "flashinfer.fused_moe": fm, "flashinfer.fused_moe.core": core}


def _prepare(monkeypatch, modules: dict, inputs: dict, intermediate: int) -> tuple:
    """vLLM 0.34.0's own ``prepare_static_weights_for_trtllm_fp4_moe`` under ``modules``."""
    import importlib

    prep = importlib.import_module(_FP4).prepare_static_weights_for_trtllm_fp4_moe
    with monkeypatch.context() as m:
        for name, mod in modules.items():
            m.setitem(sys.modules, name, mod)
        out = prep(inputs["w13"], inputs["w2"], inputs["w13_sf"], inputs["w2_sf"],
                   hidden_size=H, intermediate_size=intermediate, num_experts=E,
                   is_gated_activation=True)
    return tuple(t.view(torch.uint8) for t in out)


def _inputs(intermediate: int) -> dict:
    """Random bytes in vLLM's shapes: packed FP4 weights, linear E4M3 block scales (no 0x7f/0xff
    NaN bytes), GEMM1 rows in ``[w3; w1]`` order as vLLM hands them over."""
    gen = torch.Generator().manual_seed(intermediate)

    def rand(*shape, hi=256):
        return torch.randint(0, hi, shape, generator=gen, dtype=torch.uint8)

    rows1 = 2 * intermediate
    return {"w13": rand(E, rows1, H // 2), "w13_sf": rand(E, rows1, H // 16, hi=127),
            "w2": rand(E, H, intermediate // 2), "w2_sf": rand(E, H, intermediate // 16, hi=127)}


def test_vllm_uses_the_epilogue_tile_the_emulator_undoes():
    import importlib

    src = inspect.getsource(importlib.import_module(_FP4).prepare_static_weights_for_trtllm_fp4_moe)
    tiles = re.findall(r"epilogue_tile_m\s*=\s*(\d+)", src)
    # Reference check: vLLM's own source (:345).
    assert tiles == [str(trtllm_layout.EPILOGUE_TILE_M)]


@pytest.mark.parametrize("intermediate", INTERMEDIATES)
def test_seam_permute_indices_are_flashinfer_07s(fi, intermediate):
    """The seam's two index stand-ins give FlashInfer 0.7's indices for all four calls vLLM
    makes (weights and block scales of both GEMMs, :367-390)."""
    x = _inputs(intermediate)
    tile = trtllm_layout.EPILOGUE_TILE_M
    for name in ("w13", "w13_sf"):
        sf = 16 if name.endswith("_sf") else None
        ours = oracle_trtllm.w3_w1_permute_indices({}, x[name][0], tile, num_elts_per_sf=sf)
        # Reference check: FlashInfer 0.7's own permute-index helper.
        theirs = fi._maybe_get_cached_w3_w1_permute_indices({}, x[name][0], tile,
                                                             num_elts_per_sf=sf)
        assert torch.equal(ours, theirs), (fi.version, name)
    for name in ("w2", "w2_sf"):
        sf = 16 if name.endswith("_sf") else None
        ours = oracle_trtllm.w2_permute_indices({}, x[name][0], tile, num_elts_per_sf=sf)
        theirs = fi.get_w2_permute_indices_with_cache({}, x[name][0], tile, num_elts_per_sf=sf)
        assert torch.equal(ours, theirs), (fi.version, name)
    assert not torch.equal(ours, torch.arange(ours.numel()))  # rows really move


@pytest.mark.parametrize("intermediate", INTERMEDIATES)
def test_unshuffle_inverts_vllm_prepare_with_flashinfer_07_helpers(fi, intermediate,
                                                                    monkeypatch):
    x = _inputs(intermediate)
    with_fi = _prepare(monkeypatch, _flashinfer_07(fi), x, intermediate)
    with_seam = _prepare(monkeypatch, oracle_trtllm.flashinfer_trtllm_stub(), x, intermediate)
    g1w, g1s, g2w, g2s = with_fi
    # Reference check: the layout vLLM builds with FlashInfer 0.7's helpers is the matrix's.
    for ours, theirs in zip(with_seam, with_fi):
        assert torch.equal(ours, theirs), fi.version
    back_w13, back_w13_sf = trtllm_layout.unshuffle_gemm1(g1w, g1s)
    back_w2, back_w2_sf = trtllm_layout.unshuffle_gemm2(g2w, g2s)
    assert torch.equal(back_w13, x["w13"]) and torch.equal(back_w13_sf, x["w13_sf"])
    assert torch.equal(back_w2, x["w2"]) and torch.equal(back_w2_sf, x["w2_sf"])
    assert not torch.equal(g1w, x["w13"]) and not torch.equal(g2w, x["w2"])


@pytest.mark.parametrize("intermediate", INTERMEDIATES)
def test_flashinfer_07_public_shuffles_agree(fi, intermediate, monkeypatch):
    """vLLM's index path equals FlashInfer 0.7's public chain (``shuffle_matrix_a`` /
    ``shuffle_matrix_sf_a`` after ``reorder_rows_for_gated_act_gemm``), and FlashInfer's own
    128x4 reader gets the row-shuffled linear scales back out of what vLLM stored."""
    x = _inputs(intermediate)
    g1w, g1s, g2w, g2s = _prepare(monkeypatch, _flashinfer_07(fi), x, intermediate)
    tile = trtllm_layout.EPILOGUE_TILE_M
    rows1 = 2 * intermediate
    for e in range(E):
        w13 = fi.reorder_rows_for_gated_act_gemm(x["w13"][e])
        w13_sf = fi.reorder_rows_for_gated_act_gemm(x["w13_sf"][e])
        # Reference check: FlashInfer 0.7's shuffle_matrix_a / shuffle_matrix_sf_a.
        assert torch.equal(g1w[e], fi.shuffle_matrix_a(w13, tile))
        assert torch.equal(g1s[e].reshape(-1), fi.shuffle_matrix_sf_a(w13_sf, tile))
        assert torch.equal(g2w[e], fi.shuffle_matrix_a(x["w2"][e], tile))
        assert torch.equal(g2s[e].reshape(-1), fi.shuffle_matrix_sf_a(x["w2_sf"][e], tile))
    if fi._unswizzle_batched_sf_128x4 is None:
        pytest.skip(f"FlashInfer {fi.version}, the installed vLLM's pin (v0.20.0: 0.6.8.post1), "
                    "lacks the 128x4 reader _unswizzle_batched_sf_128x4 (0.7.4 flashinfer/trace/"
                    "templates/gemm.py:142); the shuffles above were checked")
    read1 = fi._unswizzle_batched_sf_128x4(g1s, E, rows1, H // 16)
    read2 = fi._unswizzle_batched_sf_128x4(g2s, E, H, intermediate // 16)
    # Reference check: FlashInfer 0.7's own reading of the 128x4 layout.
    src1 = trtllm_layout.gemm1_row_sources(rows1, tile)
    src2 = trtllm_layout.shuffle_row_sources(H, tile)
    assert torch.equal(read1, x["w13_sf"][:, src1]) and torch.equal(read2, x["w2_sf"][:, src2])
