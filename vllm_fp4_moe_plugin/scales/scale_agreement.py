# SPDX-License-Identifier: Apache-2.0
"""The EP group agreeing on one GEMM1 activation scale at load: the collective (one MIN
all-reduce on the CPU group it is handed, no barrier, a timeout naming the ranks behind from
progress noted in the world's store), and the quant-config values built from its result: DP
layouts quantize once on the sender, so one scalar ``g* = min_e gs_e`` over the EP group serves
every expert with ``g1_alphas[e] = ws2_e / g*`` (docs/ROOT-CAUSE.md §9). No vLLM import."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from vllm_fp4_moe_plugin.base import envs


@dataclass(frozen=True)
class Gemm1ActivationScales:
    """What GEMM1's quant config must carry for one MoE layer."""

    a1_gscale: torch.Tensor  # 1-D [E_local]: per-expert, in-kernel; 0-dim: one shared scalar
    g1_alphas: torch.Tensor  # [E_local] fp32, always per expert

    @property
    def shared(self) -> bool:
        return self.a1_gscale.dim() == 0


def per_expert_scales(gs: torch.Tensor, g1_alphas: torch.Tensor) -> Gemm1ActivationScales:
    """TP-like layouts: keep vLLM's per-expert vectors (their values are already consistent)."""
    return Gemm1ActivationScales(a1_gscale=gs.float().reshape(-1).contiguous(),
                                 g1_alphas=g1_alphas.float().reshape(-1).contiguous())


def shared_scalar_scales(g_star: torch.Tensor, ws2: torch.Tensor) -> Gemm1ActivationScales:
    """DP layouts: one quantization scale for every expert; alphas rebuilt to match it."""
    g = g_star.float().reshape(())
    return Gemm1ActivationScales(a1_gscale=g.contiguous(),
                                 g1_alphas=(ws2.float().reshape(-1) / g).contiguous())


class ScaleAgreementTimeout(RuntimeError):
    """Some ranks of the EP group never reached a layer's load-time scale agreement."""


def agree_min_scale(gs_local: torch.Tensor, group=None, *, layer: str = "",
                    timeout_s: float | None = None) -> torch.Tensor:
    """min over this rank's experts, then MIN over ``group`` (CPU/gloo; None: one rank). Every
    rank walks the MoE layers in the same order, so the collectives match one-to-one."""
    local = gs_local.detach().float().min().reshape(1).cpu()
    return _all_reduce_min(local, group, layer, timeout_s).reshape(()).to(gs_local.device)


def agree_min_max(values: torch.Tensor, group=None, *, layer: str = "",
                  timeout_s: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(min, max) over ``values`` on every rank of ``group``: one MIN all-reduce of [min, -max]."""
    v = values.detach().float()
    local = torch.stack([v.min(), -v.max()]).cpu()
    out = _all_reduce_min(local, group, layer, timeout_s).to(values.device)
    return out[0], -out[1]


def agree_range(lo: float, hi: float, group=None, *, layer: str = "",
                timeout_s: float | None = None) -> tuple[float, float]:
    """(min of ``lo``, max of ``hi``) over ``group``: one MIN all-reduce of [lo, -hi]. A rank
    with nothing to add passes (inf, -inf). Used at load so that every rank of a layer whose
    experts it splits judges that layer's calibrated activation scales as a whole."""
    out = _all_reduce_min(torch.tensor([lo, -hi], dtype=torch.float32), group, layer, timeout_s)
    return float(out[0]), -float(out[1])


def agree_max(values: torch.Tensor, group=None, *, layer: str = "",
              timeout_s: float | None = None) -> torch.Tensor:
    """max over ``values``, then MAX over ``group`` (fp32): :func:`agree_min_scale`'s 0.14.0+ twin.
    Exactly one of the inputs, so a rank whose own max equals it sees no change."""
    local = -values.detach().float().max().reshape(1).cpu()
    return -_all_reduce_min(local, group, layer, timeout_s).reshape(())


def _all_reduce_min(local: torch.Tensor, group, layer: str,
                    timeout_s: float | None) -> torch.Tensor:
    """One MIN all-reduce of ``local`` (CPU fp32) over ``group``, no barrier, waiting at most
    ``timeout_s`` (default ``VLLM_FP4_MOE_PLUGIN_TIMEOUT_S``): a timeout names the ranks behind."""
    if group is None:
        return local
    import torch.distributed as dist

    if dist.get_world_size(group) <= 1:
        return local
    if timeout_s is None:
        timeout_s = envs.VLLM_FP4_MOE_PLUGIN_TIMEOUT_S
    reached = _progress.mark(layer)
    work = dist.all_reduce(local, op=dist.ReduceOp.MIN, group=group, async_op=True)
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        behind = _progress.behind(group, reached)
        raise ScaleAgreementTimeout(
            f"{layer or 'an NVFP4 MoE layer'}: the load-time GEMM1 scale agreement over the EP "
            f"group ({dist.get_world_size(group)} ranks) timed out after {timeout_s:g} s "
            f"(VLLM_FP4_MOE_PLUGIN_TIMEOUT_S){behind}: {str(exc).strip().splitlines()[0]}. A "
            "rank died, is still loading (raise VLLM_FP4_MOE_PLUGIN_TIMEOUT_S for a slow "
            "load), or is loading a different model/layout; check that rank's log.") from exc
    return local


class _Progress:
    """This rank's agreement count in the world's store (a key per rank), to name ranks behind."""

    PREFIX = "vllm_fp4_moe_plugin/agree/"

    def __init__(self) -> None:
        self.count = 0

    def _store(self):
        import torch.distributed as dist

        try:
            return dist.distributed_c10d._get_default_store(), dist.get_rank()
        except Exception:  # no default group (a test's private group): nothing to name
            return None, None

    def mark(self, layer: str) -> int:
        self.count += 1
        store, rank = self._store()
        if store is not None:
            store.set(f"{self.PREFIX}{rank}", f"{self.count} {layer}")
        return self.count

    def behind(self, group, reached: int) -> str:
        """``"; rank 2 reached 6 of this rank's 7 agreements (last: <layer>)"`` or ``""``."""
        import torch.distributed as dist

        store, _ = self._store()
        if store is None:
            return ""
        notes = []
        for r in dist.get_process_group_ranks(group):
            key = f"{self.PREFIX}{r}"
            try:
                count, _, last = (store.get(key).decode().partition(" ")
                                  if store.check([key]) else ("0", "", ""))
            except Exception:
                continue
            if int(count) < reached:
                notes.append(f"rank {r} reached {count} of this rank's {reached} agreements"
                             + (f" (last: {last})" if last else ""))
        return ("; " + "; ".join(notes)) if notes else ""


_progress = _Progress()


def _reset_for_tests() -> None:
    _progress.count = 0
