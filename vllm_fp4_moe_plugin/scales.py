# SPDX-License-Identifier: Apache-2.0
"""What the plugin does with a layer's activation scales at load: check them, repair uncalibrated
experts (logs; refuses in strict mode), the 0.11.0 policy below (pure), and the agreement over the
EP group (one collective on a CPU group; progress noted in the world's store for its timeout).

In vLLM 0.11.0 the quant config must describe what prepare/finalize does (docs/ROOT-CAUSE.md §9).
TP-like layouts pass bf16 and the kernel quantizes each row with its expert's scale: ``gs_e`` and
``g1_alphas[e] = ws2_e / gs_e`` stay. DP layouts quantize once on the sender, before the expert is
known, so one scalar serves every expert: ``g* = min_e gs_e`` over the EP group (the largest
calibrated amax: no expert saturates more than calibrated), ``g1_alphas[e] = ws2_e / g*`` rebuilt.
No vLLM import: the collective takes its process group as an argument."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from vllm_fp4_moe_plugin import envs
from vllm_fp4_moe_plugin.log import get_logger
from vllm_fp4_moe_plugin.scale_check import InvalidScaleError, check_scale, uncalibrated

logger = get_logger("scales")


@dataclass(frozen=True)
class Gemm1ActivationScales:
    """What GEMM1's quant config must carry for one MoE layer."""

    a1_gscale: torch.Tensor  # 1-D [E_local]: per-expert, in-kernel; 0-dim: one shared scalar
    g1_alphas: torch.Tensor  # [E_local] fp32, always per expert

    @property
    def shared(self) -> bool:
        return self.a1_gscale.dim() == 0


def check_positive_finite(tensor: torch.Tensor, *, layer: str, name: str,
                          index_note: str = "", activation: bool = False) -> None:
    """Raise by ``scale_check``'s rule, naming the layer, tensor and first bad expert (qualified by
    ``index_note``). ``activation``: dtype only (:func:`repair_uncalibrated` judges values)."""
    t = tensor.detach()
    if not t.is_floating_point() or t.dtype.itemsize == 1:  # float8 scales are refused too
        check_scale([], where=layer, name=name, dtype=str(t.dtype))
    if activation:
        return
    t = t.float()
    bad = ~torch.isfinite(t) | (t <= 0)
    if not bool(bad.any()):  # the common case stays one vectorized pass
        return
    per_expert = max(1, t[0].numel()) if t.dim() else 0
    check_scale(t.reshape(-1).tolist(), where=layer, name=name, per_expert=per_expert,
                index_note=index_note)


class UncalibratedScaleError(InvalidScaleError):
    """``VLLM_FP4_MOE_PLUGIN_CHECK=strict`` and a layer has experts without calibrated scales."""


_uncalibrated_warned = False


def repair_uncalibrated(stored: torch.Tensor, *, reciprocal: bool, layer: str, name: str,
                        index_note: str = "", stock_effect: str = "",
                        missing: tuple[int, ...] | list[int] = ()) -> torch.Tensor:
    """``stored`` (one layer's activation scales, ``[E]`` or ``[E, k]``) unchanged, or a copy
    whose uncalibrated experts carry the value of the calibrated expert with the largest amax, as
    ModelOpt's exporter does. ``reciprocal``: inverse to the amax (``input_global_scale``). Logs a
    WARNING at the first such layer per process, then INFO; strict mode raises."""
    values = stored.detach().float().reshape(stored.shape[0] if stored.dim() else 1, -1)
    with torch.no_grad():
        amax = (1.0 / values) if reciprocal else values  # a stored 0 becomes inf
    flagged = uncalibrated([tuple(row) for row in amax.tolist()])
    flagged.update({e: "missing" for e in missing if 0 <= e < values.shape[0]})
    if not flagged:
        return stored
    bad = sorted(flagged)
    good = [e for e in range(values.shape[0]) if e not in flagged]
    shown = ", ".join(f"{e} (missing from the checkpoint)" if flagged[e] == "missing" else
                      f"{e} ({flagged[e]}: {_values(values[e])})" for e in bad[:8]) + (
        ", ..." if len(bad) > 8 else "")
    where = f"{layer}: {name}: expert(s) {shown}{index_note}"
    if not good:
        raise InvalidScaleError(
            f"{where}: no expert of this layer{index_note and ' on this rank'} has a calibrated "
            "activation scale, so there is nothing to fall back on; re-quantize the checkpoint "
            "with calibration data that reaches every expert (llmcompressor: "
            "moe_calibrate_all_experts=True)")
    kept = values[good]
    fallback = kept.min() if reciprocal else kept.max()
    if envs.VLLM_FP4_MOE_PLUGIN_CHECK == "strict":
        raise UncalibratedScaleError(
            f"{where}: uncalibrated activation scale (the expert saw no calibration token, or "
            f"the checkpoint has no such tensor). {stock_effect}Re-quantize with calibration that "
            "reaches every expert (llmcompressor: moe_calibrate_all_experts=True, its default), "
            "or set VLLM_FP4_MOE_PLUGIN_CHECK=warn to serve with the calibrated experts' max amax "
            "for them.")
    global _uncalibrated_warned
    log = logger.info if _uncalibrated_warned else logger.warning
    _uncalibrated_warned = True
    log("vllm-fp4-moe-plugin: %s: uncalibrated activation scale (no calibration token reached "
        "the expert, or the checkpoint has no such tensor); loading the calibrated experts' "
        "max amax instead (value %.6g), as ModelOpt's exporter does. %sRe-quantize with "
        "all-experts calibration to remove this.", where, float(fallback), stock_effect)
    out = stored.detach().clone()
    rows = torch.tensor(bad, dtype=torch.long, device=stored.device)
    out.reshape(values.shape)[rows] = fallback.to(out.dtype).to(out.device)
    return out


def _values(row: torch.Tensor) -> str:
    return "/".join(f"{float(v):.3g}" for v in row)


def _reset_for_tests() -> None:
    global _uncalibrated_warned
    _uncalibrated_warned = False
    _progress.count = 0


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
