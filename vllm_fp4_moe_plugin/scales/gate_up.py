# SPDX-License-Identifier: Apache-2.0
"""Gate and up with their own weight global scales, computed as the checkpoint means them.

Published NVFP4 MoE exports quantize gate and up each with its own global scale (GLM exports: up
to 10x apart). vLLM keeps one GEMM1 weight scale per expert, the gate's, in every release and
format (v0110 Q/modelopt.py:1299-1305; v0.34.0 Q/modelopt.py:1090-1098, CT w4a4_nvfp4.py:232-240):
the up half is dequantized with the gate's scale, ``r = ws2_gate / ws2_up`` times its value
(``ws2``: the dequantizing multiplier, ModelOpt's ``weight_scale_2``, 1 / compressed-tensors'
``weight_global_scale``).

The expert computes ``act(gate) * (r * up)``: its GEMM2 input is ``r`` times the true one, a
per-expert factor on a linear path. It is carried exactly by the expert's GEMM2 scales: the
activation scale ``a2`` (amax-like) times ``r`` quantizes ``r * x`` to the codes ``x`` gets with
``a2``, and the weight scale ``ws2`` over ``r`` dequantizes the product back (``alpha2 = a2 *
ws2`` unchanged). That is the checkpoint a calibration of the fused layer would have written, so
every kernel that reads the layer's scales computes it right. Where vLLM shares one ``a2`` over
the experts (the max), each expert's is raised first, so none saturates. No vLLM import.
"""

from __future__ import annotations

from typing import Optional

import torch

from vllm_fp4_moe_plugin.base.log import get_logger

logger = get_logger("gate_up")

# The raw tensors each format's quant method registers (every design): GEMM1's two weight
# global scales per expert [E, 2], GEMM2's weight and activation scales.
RAW = {
    "modelopt": {"w13": "w13_weight_scale_2", "w2": "w2_weight_scale_2", "a2": "w2_input_scale"},
    "compressed-tensors": {"w13": "w13_weight_global_scale", "w2": "w2_weight_global_scale",
                           "a2": "w2_input_global_scale"},
}

_logged = False


def up_factors(w13_global: torch.Tensor, fmt: str) -> Optional[torch.Tensor]:
    """Per expert, ``r``: the factor vLLM's GEMM1 puts on the up half (the gate's dequantizing
    multiplier over the up's), or None when every expert's halves agree as vLLM tests them
    (``torch.allclose``) or the tensor is not [E, 2] (non-gated experts: up only)."""
    t = w13_global.detach().float()
    if t.dim() != 2 or t.shape[1] != 2:
        return None
    gate, up = t[:, 0], t[:, 1]
    if torch.allclose(gate, up):
        return None
    return gate / up if fmt == "modelopt" else up / gate


def local_rows(layer, n_local: int, n_rows: int) -> Optional[torch.Tensor]:
    """The rows of a tensor of ``n_rows`` experts that hold this rank's ``n_local`` experts, in
    local order: all of them when it is sized to the local experts, else the global ids vLLM's
    expert map gives them (ModelOpt loads every expert's input scales, vllm#26135). None when
    neither tells."""
    if n_rows == n_local:
        return torch.arange(n_local)
    emap = getattr(layer, "expert_map", None)
    if callable(emap):
        emap = emap()
    if not isinstance(emap, torch.Tensor) or emap.numel() != n_rows:
        return None
    ids = torch.nonzero(emap.cpu() >= 0).flatten()
    return ids[torch.argsort(emap.cpu()[ids])]


def carry(r: torch.Tensor, w2_dequant: torch.Tensor, a2_amax: Optional[torch.Tensor], *,
          rows: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """GEMM2's scales with each expert's ``r`` carried (new tensors): the dequantizing weight
    multiplier ``[E_local]`` over ``r``, the amax-like activation scale times ``r`` at ``rows``
    (None: leave it, as for per-token or weight-only activation). Without ``rows``, every row
    of ``a2`` takes the largest ``r`` above 1 (an upper bound: nothing saturates)."""
    r = r.to(w2_dequant.device)
    w2 = (w2_dequant.float() / r.reshape(-1, *([1] * (w2_dequant.dim() - 1)))).to(
        w2_dequant.dtype)
    if a2_amax is None:
        return w2, None
    a2 = a2_amax.detach().clone()
    if rows is None:
        a2.mul_(max(float(r.max()), 1.0))
    else:
        a2[rows.to(a2.device)] *= r.to(a2.device, a2.dtype).reshape(-1, *([1] * (a2.dim() - 1)))
    return w2, a2


def log_carried(layer_name: str, r: torch.Tensor) -> None:
    """One INFO per process (further layers at DEBUG): what differed and what the plugin did."""
    global _logged
    split = (r - 1).abs() > 1e-5
    worst = float(torch.maximum(r, 1 / r).max())
    log = logger.debug if _logged else logger.info
    _logged = True
    log("vllm-fp4-moe-plugin: %s: gate and up weight global scales differ for %d of %d experts "
        "(up to %.4gx); vLLM reads the up half with the gate's, so the plugin carries each "
        "expert's factor in its GEMM2 scales (each half computed with its own scale); further "
        "layers at DEBUG", layer_name, int(split.sum()), r.numel(), worst)


def rewrite_raw(layer, fmt: str, layer_name: str) -> bool:
    """In place, before vLLM processes a loaded layer (pre-oracle designs): the up half's scale
    becomes the gate's and GEMM2's scales carry the factor; the layer then means what the
    checkpoint meant to every later step of vLLM. False when there is nothing to carry."""
    names = RAW[fmt]
    w13 = getattr(layer, names["w13"], None)
    if not isinstance(w13, torch.Tensor):
        return False
    r = up_factors(w13, fmt)
    if r is None:
        return False
    w2, a2 = getattr(layer, names["w2"]), getattr(layer, names["a2"], None)
    ct = fmt == "compressed-tensors"
    # compressed-tensors stores inverses (global scales): carry on their reciprocals
    w2_dequant = 1.0 / w2.data.float() if ct else w2.data
    a2_amax = (1.0 / a2.data.float() if ct else a2.data) if a2 is not None else None
    rows = local_rows(layer, r.numel(), a2.shape[0]) if a2 is not None else None
    new_w2, new_a2 = carry(r, w2_dequant, a2_amax, rows=rows)
    with torch.no_grad():
        w2.data.copy_((1.0 / new_w2.float()) if ct else new_w2)
        if a2 is not None and new_a2 is not None:
            a2.data.copy_((1.0 / new_a2.float()) if ct else new_a2)
        w13.data[:, 1] = w13.data[:, 0]
    log_carried(layer_name, r)
    return True


def _reset_for_tests() -> None:
    global _logged
    _logged = False
