# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.14.0+ (NVFP4 backend oracle): one GEMM1 activation scale agreed over the EP group.

Why and how: the ledger entry (``patches/nvfp4_oracle``); where stock is wrong:
``support.oracle_design_hole``. The wrapper replaces ``a13_scale`` by the EP group's max *before*
upstream's code runs, so upstream collapses to the same value on every rank and folds it into
``g1_alphas`` itself: quantization scale and alphas agree by construction, as ModelOpt's already
do. GEMM2 (``a2_scale``) is quantized and dequantized on the owning rank and is left alone.
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.log import get_logger, layer_label
from vllm_fp4_moe_plugin.patches.nvfp4_oracle import helper_duties, probe
from vllm_fp4_moe_plugin.scales import gate_up, layer_scales, scale_agreement, unloaded
from vllm_fp4_moe_plugin.scales.layer_scales import RAW_SCALES
from vllm_fp4_moe_plugin.scales.nvfp4_constants import E4M3_MAX, FP4_MAX

logger = get_logger("oracle")

_first_change_logged = False


def layer_format(layer) -> str | None:
    """compressed-tensors, modelopt, or None (another quant method: nothing validated)."""
    if hasattr(layer, "w13_input_global_scale"):
        return "compressed-tensors"
    if hasattr(layer, "w13_weight_scale_2") and hasattr(layer, "w13_input_scale"):
        return "modelopt"
    return None


def validate_checkpoint_scales(layer, a13_scale: torch.Tensor) -> None:
    """InvalidScaleError for a bad global scale. Input scales are skipped in per-token
    activation mode, where upstream replaces them by ones (``a13_scale`` all 1) and never
    reads the checkpoint's (v0.34.0 CT w4a4_nvfp4.py:244-248)."""
    fmt = layer_format(layer)
    if fmt is None:
        return
    per_token = bool((a13_scale == 1).all())
    for name in RAW_SCALES[fmt]["input"] + RAW_SCALES[fmt]["weight"]:
        if per_token and "input" in name:
            continue
        tensor = getattr(layer, name)
        layer_scales.check_positive_finite(tensor, layer=layer_label(layer), name=name,
                                     index_note=_index_note(layer, fmt, name),
                                     activation="input" in name)


def _index_note(layer, fmt: str, name: str) -> str:
    """compressed-tensors (and every weight scale) holds only the rank's local experts."""
    pc = layer.moe_config.moe_parallel_config
    ep_rank, ep_size = getattr(pc, "ep_rank", 0), getattr(pc, "ep_size", 1)
    local = fmt == "compressed-tensors" or "weight" in name
    return f" (local to EP rank {ep_rank} of {ep_size})" if local and ep_size > 1 else ""


# What stock 0.14.0+ does with an uncalibrated expert (docs/SUPPORT.md, uncalibrated experts).
STOCK_UNCALIBRATED = ("Stock vLLM collapses the layer's activation scales to their max amax: a "
                      "NaN, infinite or huge one becomes the scale of every token on this rank. ")


def repaired_activation_scale(layer, scale: torch.Tensor,
                              name: str) -> torch.Tensor:
    """``a13_scale`` / ``a2_scale`` (amax-like: ``1 / input_global_scale`` or ModelOpt's
    ``input_scale``) with uncalibrated experts given the calibrated max. Messages name the
    checkpoint tensor the value comes from."""
    fmt = layer_format(layer) or "compressed-tensors"
    gemm = 0 if name == "a13_scale" else 1
    source = RAW_SCALES[fmt]["input"][gemm]
    how = "1 / " if fmt == "compressed-tensors" else ""
    raw = getattr(layer, source, None)  # the checkpoint's tensor, as the loader left it
    missing = (unloaded.missing_rows(raw) if isinstance(raw, torch.Tensor) and scale.dim()
               and raw.shape[:1] == scale.shape[:1] else [])
    group = layer_scales.ep_cpu_group() if layer_scales.holds_local_slice(layer, scale) else None
    return layer_scales.repair_uncalibrated(
        scale, reciprocal=False, layer=layer_label(layer),
        name=f"{source} (vLLM's {name} = {how}{source})",
        index_note=_index_note(layer, fmt, "input"), stock_effect=STOCK_UNCALIBRATED,
        missing=missing, group=group)


def quantized_inputs_cross_ranks(layer, backend) -> bool:
    """Does this layer quantize GEMM1 input on one rank with a collapsed scale, and dequantize
    it on another? (the all-to-all kernels with EP, a global-scale backend, a sender-side
    dispatcher, and no EPLB agreement already done by upstream)."""
    pc = layer.moe_config.moe_parallel_config
    if pc.ep_size <= 1 or not pc.use_all2all_kernels:
        return False
    if backend is not None and not importlib.import_module(
            vm.NVFP4_ORACLE).is_global_sf_supported_for_nvfp4_backend(backend):
        return False  # per-expert scales (vLLM CUTLASS): quantized on the owning rank
    if getattr(pc, "enable_eplb", False) and probe.eplb_scale_allreduce():
        return False  # 0.28.0+: upstream all-reduces the collapsed scale when EPLB is on
    import vllm.envs as envs

    return support.quantizes_on_sender(
        pc.all2all_backend,
        deepep_ll_nvfp4_dispatch=bool(getattr(envs, "VLLM_DEEPEPLL_NVFP4_DISPATCH", False)))


def agreed_a13_scale(layer, a13_scale: torch.Tensor) -> torch.Tensor:
    """``a13_scale`` if this rank already holds the EP group's max amax, else a tensor of the
    same shape and dtype filled with it (upstream collapses either to that one value)."""
    from vllm.distributed import get_ep_group

    global _first_change_logged
    label = layer_label(layer)
    agreed = scale_agreement.agree_max(a13_scale, get_ep_group().cpu_group, layer=label)
    local = a13_scale.detach().float().max().cpu()
    # a13 is the scale's ModelOpt form, amax / (448 * 6); the log speaks in the checkpoint's amax
    to_amax = E4M3_MAX * FP4_MAX
    if torch.equal(local, agreed):
        logger.debug("%s: GEMM1 activation amax %.6g is already the EP group's max", label,
                     float(local) * to_amax)
        return a13_scale
    log = logger.debug if _first_change_logged else logger.info
    _first_change_logged = True
    log("vllm-fp4-moe-plugin: %s: GEMM1 activation amax agreed over the EP group, this rank's "
        "%.6g -> %.6g (stock would be off by %.4gx on tokens from other ranks); further layers "
        "at DEBUG", label, float(local) * to_amax, float(agreed) * to_amax,
        float(agreed / local))
    return torch.full_like(a13_scale, float(agreed))


def carried_gate_up(layer, call: dict) -> None:
    """Where the checkpoint gives gate and up their own weight global scales and vLLM handed
    the helper the gate's for both (checked here, per layer): each expert's factor on the up
    half moves into GEMM2's scales (``gate_up.carry``), in ``call``'s arguments."""
    fmt = layer_format(layer)
    raw = getattr(layer, gate_up.RAW[fmt]["w13"], None) if fmt else None
    if fmt is None or not isinstance(raw, torch.Tensor):
        return
    r = gate_up.up_factors(raw, fmt)
    if r is None:
        return
    gate = raw.detach().float()[:, 0]
    gate = 1.0 / gate if fmt == "compressed-tensors" else gate  # the dequantizing multiplier
    used, w2 = call.get("w13_scale_2"), call.get("w2_scale_2")
    if (used is None or w2 is None or used.shape != gate.shape
            or not torch.allclose(used.detach().float().cpu(), gate.cpu())):
        logger.warning("vllm-fp4-moe-plugin: %s: gate and up weight global scales differ, but "
                       "vLLM did not hand the NVFP4 helper the gate's for both halves as this "
                       "plugin expects; left as vLLM computes it", layer_label(layer))
        return
    a2, a13 = call.get("a2_scale"), call.get("a13_scale")
    dynamic = a2 is None or (a13 is not None and bool((a13 == 1).all()))  # per-token: no a2
    rows = None if a2 is None or dynamic else gate_up.local_rows(layer, r.numel(), a2.shape[0])
    call["w2_scale_2"], new_a2 = gate_up.carry(r, w2, None if dynamic else a2, rows=rows)
    if new_a2 is not None:
        call["a2_scale"] = new_a2
    gate_up.log_carried(layer_label(layer), r)


def build_agreed_prepare(original, *, agree: bool = True, repair: bool = True,
                         carry: bool = True):
    """The wrapper of one oracle helper (see the module docstring). ``agree`` / ``repair`` /
    ``carry``: the duties upstream does not do itself (``patches/nvfp4_oracle.duties``)."""
    sig = inspect.signature(original)
    per_backend = "backend" in sig.parameters

    def prepare(*args, **kwargs):
        call = sig.bind(*args, **kwargs)
        layer, a13 = call.arguments["layer"], call.arguments["a13_scale"]
        checkpoint = not unloaded.dummy_weights(layer)  # --load-format dummy: none
        if a13 is not None:
            if checkpoint:
                validate_checkpoint_scales(layer, a13)
            if repair and checkpoint:
                a13 = call.arguments["a13_scale"] = repaired_activation_scale(layer, a13,
                                                                              "a13_scale")
                a2 = call.arguments.get("a2_scale")
                if a2 is not None:
                    call.arguments["a2_scale"] = repaired_activation_scale(layer, a2, "a2_scale")
            if agree and quantized_inputs_cross_ranks(layer, call.arguments.get("backend")
                                                      if per_backend else None):
                call.arguments["a13_scale"] = agreed_a13_scale(layer, a13)
        if carry and checkpoint:
            carried_gate_up(layer, call.arguments)
        return original(*call.args, **call.kwargs)

    functools.update_wrapper(prepare, original)
    prepare.__module__ = __name__
    return prepare


def build(original):
    """The ledger's builder: the wrapper with the duties this vLLM still needs."""
    findings = {**probe.probe_upstream_fixes(),
                "upstream_refuses_uncalibrated": probe.upstream_refuses_uncalibrated()}
    return build_agreed_prepare(original, **helper_duties(findings))


def build_check(original):
    """The ledger's builder for vLLM's refusal of uncalibrated activation scales (upstream/0002):
    the plugin's repair in front of it, so vLLM checks what the plugin loads."""

    @functools.wraps(original)
    def check_nvfp4_moe_input_scales(layer, a13_scale, a2_scale, *args, **kwargs):
        if not unloaded.dummy_weights(layer):  # --load-format dummy: nothing to repair
            validate_checkpoint_scales(layer, a13_scale)
            a13_scale = repaired_activation_scale(layer, a13_scale, "a13_scale")
            a2_scale = repaired_activation_scale(layer, a2_scale, "a2_scale")
        return original(layer, a13_scale, a2_scale, *args, **kwargs)

    check_nvfp4_moe_input_scales.__module__ = __name__
    return check_nvfp4_moe_input_scales


def _reset_for_tests() -> None:
    global _first_change_logged
    _first_change_logged = False
