"""The activation-scale policy, as pure functions of per-expert scales and the parallel layout.

Why a policy at all: in vLLM 0.11.0 the quant config must describe what prepare/finalize really
does (docs/ROOT-CAUSE.md §9):

* TP-like layouts (single GPU, PP, TP, TP+EP) pass bf16 through; the FlashInfer kernel quantizes
  each routed row with its own expert's scale. The config carries the per-expert vector
  ``gs_e`` and ``g1_alphas[e] = ws2_e / gs_e`` -- the checkpoint's calibration, unchanged.
* DP layouts quantize once on the sender, before the destination expert is known, so one scalar
  must serve every expert on every EP rank. We use ``g* = min_e gs_e`` over the whole EP group
  (the largest calibrated activation amax, so no expert saturates more than it was calibrated
  for) and rebuild ``g1_alphas[e] = ws2_e / g*`` so ``alpha_e * g* == ws2_e`` holds exactly.

Nothing here imports vLLM; the one collective takes the process group as an argument.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class InvalidScaleError(ValueError):
    """A checkpoint scale that would silently poison every token routed through it."""


@dataclass(frozen=True)
class Gemm1ActivationScales:
    """What GEMM1's quant config must carry for one MoE layer."""

    a1_gscale: torch.Tensor  # 1-D [E_local]: per-expert, in-kernel; 0-dim: one shared scalar
    g1_alphas: torch.Tensor  # [E_local] fp32, always per expert

    @property
    def shared(self) -> bool:
        return self.a1_gscale.dim() == 0


def check_positive_finite(tensor: torch.Tensor, *, layer: str, name: str,
                          index_note: str = "") -> None:
    """Raise, naming the layer, the tensor and the first bad expert, on NaN/inf/zero/negative.
    ``index_note`` qualifies the expert index (e.g. local to an EP rank)."""
    t = tensor.detach().float()
    bad = ~torch.isfinite(t) | (t <= 0)
    if not bool(bad.any()):
        return
    first = bad.nonzero()[0].tolist() if t.dim() else []
    value = float(t[tuple(first)])
    kind = "NaN" if value != value else ("inf" if abs(value) == float("inf") else
                                          ("zero" if value == 0 else "negative"))
    where = f" at expert index {first[0]}{index_note}" if first else ""
    raise InvalidScaleError(
        f"{layer}: checkpoint scale {name!r} is {kind} ({value!r}){where} "
        f"[{int(bad.sum())} of {t.numel()} entries are bad]. NVFP4 global scales must be finite "
        "and > 0; re-export or repair this tensor in the checkpoint."
    )


def per_expert_scales(gs: torch.Tensor, g1_alphas: torch.Tensor) -> Gemm1ActivationScales:
    """TP-like layouts: keep vLLM's per-expert vectors (their values are already consistent)."""
    return Gemm1ActivationScales(
        a1_gscale=gs.float().reshape(-1).contiguous(),
        g1_alphas=g1_alphas.float().reshape(-1).contiguous(),
    )


def shared_scalar_scales(g_star: torch.Tensor, ws2: torch.Tensor) -> Gemm1ActivationScales:
    """DP layouts: one quantization scale for every expert; alphas rebuilt to match it."""
    g = g_star.float().reshape(())
    return Gemm1ActivationScales(
        a1_gscale=g.contiguous(),
        g1_alphas=(ws2.float().reshape(-1) / g).contiguous(),
    )


def agree_min_scale(gs_local: torch.Tensor, group=None) -> torch.Tensor:
    """min over this rank's experts, then MIN all-reduce over ``group`` (a CPU/gloo group).

    Every rank of the EP group walks the MoE layers in the same order at weight-processing time,
    so this collective is matched one-to-one across ranks. ``group=None`` means a single rank.
    """
    local = gs_local.detach().float().min().reshape(1).cpu()
    if group is not None:
        import torch.distributed as dist

        if dist.get_world_size(group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MIN, group=group)
    return local.reshape(()).to(gs_local.device)


def agree_max(values: torch.Tensor, group=None) -> torch.Tensor:
    """max over ``values``, then MAX all-reduce over ``group`` (a CPU/gloo group), in fp32.

    The 0.14.0+ twin of :func:`agree_min_scale`: vLLM there works with the activation amax
    (``1 / input global scale``) and collapses it with a max. The result is exactly one of the
    inputs (a max is exact), so a rank whose own max already equals it sees no change.
    """
    local = values.detach().float().max().reshape(1).cpu()
    if group is not None:
        import torch.distributed as dist

        if dist.get_world_size(group) > 1:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return local.reshape(())
