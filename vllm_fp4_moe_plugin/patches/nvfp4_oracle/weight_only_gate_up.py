# SPDX-License-Identifier: Apache-2.0
"""Split gate/up weight scales on the oracle's weight-only (Marlin, W4A16) path.

The oracle hands Marlin's helper the gate's weight global scale for both GEMM1 halves, as it
does the FlashInfer/CUTLASS helpers; with no activation quantization, GEMM2's weight scale
alone carries each expert's factor (``gate_up.carry`` without ``a2``), as the scale wrapper
does for the other kernels (``ep_agreed_gemm1_scale.carried_gate_up``). Load time only."""

from __future__ import annotations

import functools
import inspect

from vllm_fp4_moe_plugin.patches.nvfp4_oracle.ep_agreed_gemm1_scale import carried_gate_up
from vllm_fp4_moe_plugin.scales import unloaded


def build(original):
    """The ledger's builder: the helper with GEMM2's weight scale carrying a split gate/up."""
    sig = inspect.signature(original)

    def prepare(*args, **kwargs):
        call = sig.bind(*args, **kwargs)
        if not unloaded.dummy_weights(call.arguments["layer"]):
            carried_gate_up(call.arguments["layer"], call.arguments)
        return original(*call.args, **call.kwargs)

    functools.update_wrapper(prepare, original)
    prepare.__module__ = __name__
    return prepare
