# SPDX-License-Identifier: Apache-2.0
"""Instruments for the one documented hardware seam (``simulation/blackwell.py``).

Must be entered *inside* ``simulated_blackwell()`` (the spawned ranks of
``simulation.layouts.spawn`` already are): it wraps or replaces the module attributes the seam
installed, and puts them back on exit. Nothing else in vLLM or the plugin is touched.

* :func:`counting` counts every ``fp4_quantize`` that runs before the MoE kernel (the call
  vLLM's prepare makes through ``fused_moe.utils``) and the activation bytes it reads and
  writes, plus what the kernel is handed as its activation input.
* :func:`host_only` swaps the emulated device work (quantizer, SF interleave, MoE kernel) for
  no-ops that return correctly shaped tensors, so a timing sees only vLLM + plugin host code.
"""

from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

_UTILS = "vllm.model_executor.layers.fused_moe.utils"
_FX = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe"
_PF = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize"


def _nbytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


@dataclass
class Tally:
    passes: int = 0  # fp4_quantize calls before the first kernel call of this forward
    bytes_in: int = 0  # activation bytes those passes read
    bytes_out: int = 0  # packed codes + block scales they wrote
    kernel_calls: int = 0
    kernel_input: list = field(default_factory=list)  # (dtype, bytes incl. input_sf)

    def reset(self) -> None:
        self.passes = self.bytes_in = self.bytes_out = self.kernel_calls = 0
        self.kernel_input = []

    def as_dict(self) -> dict:
        return {"passes": self.passes, "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
                "pre_kernel_bytes": self.bytes_in + self.bytes_out,
                "kernel_calls": self.kernel_calls, "kernel_input": self.kernel_input}


class _Swap:
    def __init__(self) -> None:
        self._undo: list = []

    def set(self, module: str, attr: str, value) -> object:
        mod = importlib.import_module(module)
        old = getattr(mod, attr)
        self._undo.append((mod, attr, old))
        setattr(mod, attr, value)
        return old

    def undo(self) -> None:
        while self._undo:
            mod, attr, old = self._undo.pop()
            setattr(mod, attr, old)


@contextlib.contextmanager
def counting() -> Iterator[Tally]:
    tally = Tally()
    swap = _Swap()
    utils = importlib.import_module(_UTILS)
    fx = importlib.import_module(_FX)
    quantize, kernel = utils.fp4_quantize, fx.flashinfer_cutlass_fused_moe

    def counted_quantize(input, global_scale=None, *args, **kwargs):
        out = quantize(input, global_scale, *args, **kwargs)
        if tally.kernel_calls == 0:
            tally.passes += 1
            tally.bytes_in += _nbytes(input)
            tally.bytes_out += _nbytes(out[0]) + _nbytes(out[1])
        return out

    def counted_kernel(*args, **kwargs):
        x = kwargs.get("input", args[0] if args else None)
        tally.kernel_calls += 1
        tally.kernel_input.append((str(x.dtype), _nbytes(x) + _nbytes(kwargs.get("input_sf"))))
        return kernel(*args, **kwargs)

    swap.set(_UTILS, "fp4_quantize", counted_quantize)
    swap.set(_FX, "flashinfer_cutlass_fused_moe", counted_kernel)
    try:
        yield tally
    finally:
        swap.undo()


def _pad(x: int, a: int) -> int:
    return (x + a - 1) // a * a


def _noop_quantize(input, global_scale=None, sf_vec_size=16, sf_use_ue8m0=False,
                   is_sf_swizzled_layout=True, *args, **kwargs):
    """Shapes of FlashInfer 0.3.1 ``fp4_quantize`` (see nvfp4/flashinfer_contract.py), no math."""
    m, k = input.reshape(-1, input.shape[-1]).shape
    rows = _pad(m, 128) if is_sf_swizzled_layout else m
    cols = _pad(k // sf_vec_size, 4) if is_sf_swizzled_layout else k // sf_vec_size
    xq = torch.empty(*input.shape[:-1], k // 2, dtype=torch.uint8, device=input.device)
    sf = torch.empty(rows * cols, dtype=torch.uint8, device=input.device)
    return xq, sf.reshape(-1, k // sf_vec_size)


def _noop_kernel(*args, output=None, **kwargs):
    """``cutlass_fused_moe`` returning the caller's output buffer unwritten (vLLM passes one)."""
    return [output]


@contextlib.contextmanager
def host_only() -> Iterator[None]:
    swap = _Swap()
    swap.set(_UTILS, "fp4_quantize", _noop_quantize)
    swap.set(_PF, "nvfp4_block_scale_interleave", lambda sf: sf)
    swap.set(_FX, "flashinfer_cutlass_fused_moe", _noop_kernel)
    try:
        yield
    finally:
        swap.undo()
