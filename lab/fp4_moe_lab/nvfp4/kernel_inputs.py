# SPDX-License-Identifier: Apache-2.0
"""Turn a :class:`QuantizedExperts` into exactly what vLLM 0.11.0 hands FlashInfer's MoE kernel.

Why: emulator tests must call ``cutlass_fused_moe`` the way vLLM does, so that a test of the
stock path reproduces the stock bug and a test of the fix exercises the same tensors. Mirrors
(vLLM 0.11.0, ``model_executor/layers/...``):

* ``[w1; w3] -> [w3; w1]`` for weights and block scales (``utils/flashinfer_fp4_moe.py:34-47``,
  called from ``modelopt.py:1289-1292``);
* per-expert 128x4 swizzle of the block scales (``swizzle_blockscale``, ``quant_utils.py:591-634``;
  ``compressed_tensors_moe.py:290-296``);
* ``g1_alphas = (1 / a1_gs) * w13_weight_scale_2`` with ``w13_weight_scale_2 = 1 / w13_weight_gs``
  (``compressed_tensors_moe.py:279-308``; ModelOpt's ``in13 * ws2`` is the same number);
* the views ``w.view(torch.long)`` and ``w_scale.view(torch.int32)``
  (``fused_moe/flashinfer_cutlass_moe.py:153-170``).
"""

from __future__ import annotations

from typing import Optional

import torch

from .layout import swizzle_128x4
from .reference import QuantizedExperts


def _alpha(act_gs: torch.Tensor, weight_gs: torch.Tensor) -> torch.Tensor:
    return ((1 / act_gs) * (1 / weight_gs)).to(torch.float32).reshape(-1).contiguous()


def to_flashinfer_inputs(experts: QuantizedExperts, *, a1_gs,
                         a2_gs: Optional[torch.Tensor] = None) -> dict:
    """kwargs ``fc1_expert_weights``, ``fc2_expert_weights``, ``quant_scales`` for
    ``cutlass_fused_moe``. ``a1_gs``/``a2_gs``: 1-D ``[E]`` (per expert) or 0-dim (shared); the
    alphas are always per expert ``[E]`` and consistent with the scale given, i.e. exactly what
    the kernel needs IF it quantizes with that scale (``a2_gs`` defaults to ``w2_input_gs``)."""
    dev = experts.device
    a1 = torch.as_tensor(a1_gs, dtype=torch.float32).to(dev)
    a2 = experts.w2_input_gs if a2_gs is None else torch.as_tensor(a2_gs, dtype=torch.float32)
    a2 = a2.to(dev)
    ones = torch.ones(experts.num_experts, dtype=torch.float32, device=dev)
    w13 = torch.cat([experts.w3, experts.w1], dim=1).contiguous()
    w13_sf = swizzle_128x4(torch.cat([experts.w3_sf, experts.w1_sf], dim=1))
    w2_sf = swizzle_128x4(experts.w2_sf)
    quant_scales = [
        a1.contiguous(),
        w13_sf.view(torch.int32),
        _alpha(a1 * ones, experts.w13_weight_gs),
        a2.contiguous(),
        w2_sf.view(torch.int32),
        _alpha(a2 * ones, experts.w2_weight_gs),
    ]
    return {
        "fc1_expert_weights": w13.view(torch.long),
        "fc2_expert_weights": experts.w2.contiguous().view(torch.long),
        "quant_scales": quant_scales,
    }
