# SPDX-License-Identifier: Apache-2.0
"""Instruments for the NVFP4-oracle seam (``simulation/blackwell_oracle.py``, vLLM 0.14.0+).

The 0.34.0 twin of :mod:`benchmarks.seam`; enter it *inside* ``simulated_blackwell()`` (the
spawned ranks of ``simulation.layouts.spawn`` are). Nothing in vLLM or the plugin is changed:

* :func:`host_only` swaps the seam's emulated device work (vLLM's ``scaled_fp4_quant`` op, the
  SF interleave on the dispatch path, FlashInfer's ``cutlass_fused_moe``) for no-ops returning
  correctly shaped tensors, so a timing sees only vLLM + plugin host code and the gloo transport.
* :func:`counting_calls` counts calls of given functions by their code objects (a profile
  hook), so a call through *any* reference counts -- the oracle's module global, a closure's
  ``original``, an import elsewhere.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Iterator

import torch

from benchmarks.seam import _Swap

_FM = "vllm.model_executor.layers.fused_moe"
_OPS = "vllm._custom_ops"
_NAIVE_DP_EP = f"{_FM}.prepare_finalize.naive_dp_ep"


def _pad(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _noop_scaled_fp4_quant(input, input_global_scale=None, is_sf_swizzled_layout=True,
                           backend="none", padded_n=None):
    """Shapes of vLLM's ``scaled_fp4_quant`` (as the seam's emulated op returns them), no math."""
    n = input.shape[-1]
    m = input.reshape(-1, n).shape[0]
    q = torch.empty(m, n // 2, dtype=torch.uint8)
    if is_sf_swizzled_layout:
        sf = torch.empty(_pad(m, 128), _pad(n // 16, 4), dtype=torch.uint8)
    else:
        sf = torch.empty(m, n // 16, dtype=torch.uint8)
    return q, sf.view(torch.float8_e4m3fn)


def _noop_kernel(*args, output=None, **kwargs):
    """FlashInfer's ``cutlass_fused_moe``: the caller's output buffer, unwritten."""
    return [output]


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    from fp4_moe_lab.simulation import blackwell_oracle

    swap = _Swap()
    swap.set(_OPS, "scaled_fp4_quant", _noop_scaled_fp4_quant)
    if hasattr(importlib.import_module(_NAIVE_DP_EP), "nvfp4_block_scale_interleave"):
        swap.set(_NAIVE_DP_EP, "nvfp4_block_scale_interleave", lambda sf: sf)
    swap.set(blackwell_oracle.experts_module().__name__, "flashinfer_cutlass_fused_moe",
             _noop_kernel)
    try:
        yield
    finally:
        swap.undo()


WRAPPER = "plugin wrapper (ep_agreed_gemm1_scale)"


def helper_functions() -> dict:
    """name -> function for everything the plugin runs at load on this design, to be called
    while the plugin's patches are applied: its wrapper (one code object serves both oracle
    helpers, so it is one entry), the stock helpers it wraps, and the EP collective
    (``scale_agreement.agree_max``)."""
    from vllm_fp4_moe_plugin.base import vllm_modules as vm
    from vllm_fp4_moe_plugin.scales import scale_agreement

    oracle = importlib.import_module(vm.NVFP4_ORACLE)
    out = {"scale_agreement.agree_max": scale_agreement.agree_max}
    for name in vm.ORACLE_HELPERS:
        fn = getattr(oracle, name, None)
        if fn is None:
            continue
        inner = getattr(fn, "__wrapped__", None)
        if inner is None:
            raise RuntimeError(f"{name} is not the plugin's wrapper: apply the patches first")
        out[WRAPPER] = fn
        out[f"{name} (stock)"] = inner
    return out


@contextlib.contextmanager
def counting_calls(functions: dict) -> Iterator[dict]:
    """``{name: calls}`` of ``functions`` while the block runs (this thread)."""
    codes = {fn.__code__: name for name, fn in functions.items()}
    if len(codes) != len(functions):
        raise ValueError("two of the functions share a code object: count them as one")
    counts = {name: 0 for name in functions}

    def hook(frame, event, arg):
        if event == "call":
            name = codes.get(frame.f_code)
            if name is not None:
                counts[name] += 1

    previous = sys.getprofile()
    sys.setprofile(hook)
    try:
        yield counts
    finally:
        sys.setprofile(previous)
