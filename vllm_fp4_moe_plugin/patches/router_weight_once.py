# SPDX-License-Identifier: Apache-2.0
"""Llama-4's router weight on the input counted once by the NVFP4 experts: the whole patch (its
ledger entries, the findings they read, the wrapper), on every vLLM whose modular kernel hands
its experts the router weights through one method: ``_fused_experts`` (0.11.1 and later),
``_maybe_chunk_fused_experts`` (0.11.0).

With ``apply_router_weight_on_input`` (top-1: Llama-4), every prepare/finalize but vLLM's
passthrough one scales the input by the router weight before quantizing and dispatching it
(v0120 flashinfer_cutlass_prepare_finalize.py:57-70, in place; v0.34.0
FM/prepare_finalize/no_dp_ep.py:74-80, naive_dp_ep.py:185-190, flashinfer_nvlink_one_sided.py:
113-118), and the NVFP4 experts weight again: FlashInfer's CUTLASS, CuteDSL and B12X experts hand
the kernel ``token_final_scales=topk_weights`` for its output (v0120 flashinfer_cutlass_moe.py:
211-213, v0.34.0 FM/experts/flashinfer_cutlass_moe.py:375), vLLM's CUTLASS scales its input by
them a second time (FM/experts/cutlass_moe.py:612-617; vllm#43694, open). Where the prepare
applied the weight, the wrapper hands the experts unit weights, so the weight counts exactly once
whichever experts class runs; the finalize keeps the real weights (under the flag it does not
weight). Per MoE layer call it adds a flag lookup and the keyword re-pass, ~0.7 us of host time
(CPU, docs/VERIFICATION.md V84; none inside a replayed CUDA graph), and on Llama-4 layers one
``ones_like`` of ``[m, 1]``. The finding ``experts_call`` names the method the installed vLLM
has; where it names none, nothing is applied.

In 0.11.0 and 0.12.0 the DP-chunked forward (DP with FlashInfer CUTLASS, pplx
or DeepEP LL) also drops the flag: ``FusedMoE.forward_impl_chunked`` calls the quant method
without it (v0120 fused_moe/layer.py:1799-1820; ``forward_impl`` passes it, :1980), so the layer
weights the expert's output instead of its input. On NVFP4 layers the last entry hands it on.
0.13.0's ``apply`` reads the flag from the layer (neither call site passes it): not applied.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import sys
import textwrap

from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.base.log import get_logger
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches.patching import Finding, ModulePatch, Patch, original_attr

# The modular kernel: prepare/finalize and experts side by side, and the method that hands the
# experts the router weights and the on-input flag, first match wins: 0.32.0 and 0.34.0
# FusedMoEKernelModularImpl._fused_experts (v0.34.0 FM/modular_kernel.py:1155, 1383-1475);
# 0.11.1-0.2x FusedMoEModularKernel._fused_experts; 0.11.0 FusedMoEModularKernel.
# _maybe_chunk_fused_experts (v0110 fused_moe/modular_kernel.py:723-855, called from forward
# with both by keyword, :971-986).
MODULAR_KERNEL = f"{vm.FUSED_MOE}.modular_kernel"
EXPERTS_CALLS = ("FusedMoEKernelModularImpl._fused_experts",
                 "FusedMoEModularKernel._fused_experts",
                 "FusedMoEModularKernel._maybe_chunk_fused_experts")
FUSED_EXPERTS_PARAMS = ("topk_weights", "apply_router_weight_on_input")
FUSED_MOE_LAYER = f"{vm.FUSED_MOE}.layer"  # FusedMoE, up to 0.27.x
# FlashInfer's CUTLASS experts class: experts/ from 0.32.0, fused_moe/ before
FLASHINFER_CUTLASS_EXPERTS = (f"{vm.FUSED_MOE}.experts.flashinfer_cutlass_moe",
                              vm.FLASHINFER_CUTLASS_MOE)

logger = get_logger("router_weight")

# How a prepare applies the router weight to its input: ``a1 * topk_weights``,
# ``a1.mul_(topk_weights...)``, or the two-sided NVLink prepare's helper.
_APPLIES = re.compile(r"\*\s*topk_weights|\.mul_?\(\s*topk_weights|_apply_router_weight_on_input\(")
_logged = False


_APPLIES_BY_CLASS: dict[type, bool] = {}


def prepare_applies_weight(cls: type) -> bool:
    """Does this prepare/finalize class scale its input by the router weight under the flag?
    Read from the source of the module that defines its ``prepare`` (the passthrough prepare
    hands the input on as it is, mori's refuses the flag: no)."""
    if cls not in _APPLIES_BY_CLASS:
        owner = next((c for c in cls.__mro__ if "prepare" in vars(c)), None)
        module = sys.modules.get(getattr(owner, "__module__", ""))
        try:
            found = module is not None and bool(_APPLIES.search(inspect.getsource(module)))
        except (OSError, TypeError):
            found = False
        _APPLIES_BY_CLASS[cls] = found
    return _APPLIES_BY_CLASS[cls]


def weights_once(kernel) -> bool:
    """This modular kernel runs NVFP4 experts behind a prepare that applied the weight already
    (decided once per kernel object)."""
    known = getattr(kernel, "_fp4_moe_unit_weights", None)
    if known is None:
        config = getattr(kernel.fused_experts, "quant_config", None)
        known = (getattr(config, "quant_dtype", None) == "nvfp4"
                 and prepare_applies_weight(type(kernel.prepare_finalize)))
        kernel._fp4_moe_unit_weights = known
    return known


def build(original):
    """The experts call (:data:`EXPERTS_CALLS`) that hands NVFP4 experts unit weights where the
    prepare applied the router weight to the input."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def experts_call(self, *args, **kwargs):
        if args:  # vLLM calls it by keyword; anything else is bound once here
            call = sig.bind(self, *args, **kwargs)
            self, kwargs = call.arguments.pop("self"), call.arguments
        if not (kwargs.get("apply_router_weight_on_input") and weights_once(self)):
            return original(self, **kwargs)
        _log_once(self)
        return original(self, **{**kwargs, "topk_weights": _ones_like(kwargs["topk_weights"])})

    experts_call.__module__ = __name__
    return experts_call


def build_chunked(original):
    """``FusedMoE.forward_impl_chunked`` that hands the quant method the layer's on-input flag
    (NVFP4 layers with the flag only: every other layer runs the original untouched)."""
    @functools.wraps(original)
    def forward_impl_chunked(self, *args, **kwargs):
        if not (getattr(self, "apply_router_weight_on_input", False)
                and any(hasattr(self, m) for m in vm.NVFP4_MOE_MARKERS)):
            return original(self, *args, **kwargs)
        method = self.quant_method
        own = vars(method).get("apply")  # an instance attribute of its own, kept
        method.apply = functools.partial(method.apply, apply_router_weight_on_input=True)
        try:
            return original(self, *args, **kwargs)
        finally:
            if own is None:
                del method.apply
            else:
                method.apply = own

    forward_impl_chunked.__module__ = __name__
    return forward_impl_chunked


def _ones_like(tensor):
    import torch

    return torch.ones_like(tensor)


def _log_once(kernel) -> None:
    global _logged
    if not _logged:
        _logged = True
        logger.info("vllm-fp4-moe-plugin: router weight on the input (top-1, Llama-4): %s "
                    "applied it, so %s gets unit weights (stock weights each token twice)",
                    type(kernel.prepare_finalize).__name__, type(kernel.fused_experts).__name__)


def _reset_for_tests() -> None:
    global _logged
    _logged = False


def experts_call() -> str:
    """The modular kernel method that hands the experts the router weights and the on-input
    flag (the first of :data:`EXPERTS_CALLS` this vLLM has with both parameters), or ``""``."""
    for name in EXPERTS_CALLS:
        try:
            fn = original_attr(MODULAR_KERNEL, name)
        except (ImportError, AttributeError):
            continue
        if all(p in inspect.signature(fn).parameters for p in FUSED_EXPERTS_PARAMS):
            return name
    return ""


def nvfp4_experts_weight_again() -> bool:
    """Read from the source: does FlashInfer's CUTLASS experts class hand its kernel the router
    weights for the output without reading the on-input flag (v0120 flashinfer_cutlass_moe.py:
    211-213, v0.34.0 FM/experts/flashinfer_cutlass_moe.py:252-375), or vLLM's CUTLASS FP4
    function scale its input by them a second time (FM/experts/cutlass_moe.py:612-617)? Either
    weights a Llama-4 token twice after the prepare applied the weight. Stock 0.11.0-0.34.0: the
    first (vllm#43694, open, is about the second)."""
    sources = []
    for module in FLASHINFER_CUTLASS_EXPERTS:
        cls = getattr(_module_or_none(module), "FlashInferExperts", None)
        if cls is not None and callable(getattr(cls, "apply", None)):
            src = inspect.getsource(cls.apply)
            sources.append("token_final_scales=topk_weights" in src
                           and src.count("apply_router_weight_on_input") <= 1)  # the parameter
            break
    try:
        src = inspect.getsource(original_attr(vm.CUTLASS_MOE, vm.CUTLASS_MOE_FP4))
        sources.append(bool(re.search(r"\ba\.mul_\(\s*topk_weights", src)))
    except Exception:  # absent, or a CUDA-only module that does not import here
        pass
    return any(sources)


def _module_or_none(name: str):
    try:
        return importlib.import_module(name)
    except Exception:
        return None


def dp_chunked_drops_flag() -> bool:
    """Read from the source: does ``FusedMoE.forward_impl`` hand the quant method's ``apply``
    the on-input flag by keyword while ``forward_impl_chunked`` does not (v0110 and v0120
    fused_moe/layer.py)? False where both leave it out because ``apply`` reads it from the layer
    (v0130 layer.py:1817, 1960; FusedMoEModularMethod.apply(layer, x, router_logits)), and where
    FusedMoE or the method is gone (0.34.0)."""
    cls = getattr(_module_or_none(FUSED_MOE_LAYER), "FusedMoE", None)
    full, chunked = (_apply_calls_pass_flag(getattr(cls, name, None))
                     for name in ("forward_impl", "forward_impl_chunked"))
    return full is True and chunked is False


def _apply_calls_pass_flag(fn):
    """True / False: every / not every ``*.apply(...)`` call in ``fn`` passes the on-input flag
    by keyword; None: no such function or call."""
    if fn is None:
        return None
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = [c for c in ast.walk(tree) if isinstance(c, ast.Call)
             and isinstance(c.func, ast.Attribute) and c.func.attr == "apply"]
    if not calls:
        return None
    return all(any(k.arg == "apply_router_weight_on_input" for k in c.keywords) for c in calls)


def router_weight_needed(findings) -> bool:
    """vLLM's modular kernel is one the plugin recognises, and an NVFP4 experts class still
    weights a token whose router weight the prepare applied to the input (no upstream fix)."""
    return bool(findings.get("experts_call")) and bool(
        findings.get("nvfp4_experts_weight_again"))


def _needed_for(name: str):
    def needed(findings) -> bool:
        """This is the installed vLLM's experts call, and an NVFP4 experts class still weights
        a token whose router weight the prepare applied to the input."""
        return findings.get("experts_call") == name and router_weight_needed(findings)
    return needed


def chunked_needed(findings) -> bool:
    """vLLM's DP-chunked forward drops the on-input flag, and the experts' second weighting
    is undone by the entries above (without them the flag would weight a token twice)."""
    return bool(findings.get("dp_chunked_drops_flag")) and router_weight_needed(findings)


WORDS = ("the NVFP4 experts weight a token again after the prepare applied its router weight to "
         "the input (Llama-4)")
PATCH = Patch(
    designs=tuple(Design),
    entries=tuple(ModulePatch(
        module=MODULAR_KERNEL, attr=name, build=f"{__name__}:build",
        needed=_needed_for(name),
        why=("Llama-4 (top-1) applies the router weight to the MoE input. Every prepare/finalize "
             "but the passthrough one scales the input by it (v0120 flashinfer_cutlass_prepare_"
             "finalize.py:57-70; v0.34.0 FM/prepare_finalize/no_dp_ep.py:74-80), and the NVFP4 "
             "experts weight again: FlashInfer's CUTLASS, CuteDSL and B12X kernels scale their "
             "output by token_final_scales=topk_weights (v0.34.0 FM/experts/"
             "flashinfer_cutlass_moe.py:375), vLLM's CUTLASS its input a second time "
             "(FM/experts/cutlass_moe.py:612-617): every token's expert output is off by its "
             "router weight, on every layout."),
        how=("Wraps the modular kernel's experts call: with the on-input flag, NVFP4 experts and "
             "a prepare that applied the weight (read once per prepare class from its source), "
             "the experts get unit weights; the finalize keeps the real ones."),
        upstream=("vllm#43694 (open) fixes vLLM's CUTLASS FP8/FP4 paths; FlashInfer's experts "
                  "classes are not covered by any PR seen."),
        remove_when=("finding 'nvfp4_experts_weight_again' false on every supported release, or "
                     "'experts_call' empty."),
    ) for name in EXPERTS_CALLS) + (ModulePatch(
        module=FUSED_MOE_LAYER, attr="FusedMoE.forward_impl_chunked",
        build=f"{__name__}:build_chunked", needed=chunked_needed,
        why=("In 0.11.0-0.12.0 the DP-chunked forward (DP with FlashInfer CUTLASS, pplx, DeepEP "
             "LL) calls the quant method without apply_router_weight_on_input (v0120 fused_moe/"
             "layer.py:1799-1820; forward_impl passes it, :1980): under DP a Llama-4 layer "
             "weights each expert's output, not its input."),
        how=("Wraps FusedMoE.forward_impl_chunked: on an NVFP4 layer with the flag, its quant "
             "method's apply gets the flag for the call; the entries above then weight once."),
        upstream=("None for 0.11.x-0.12.x. From 0.13.0 the quant method's apply reads the flag "
                  "from the layer (v0130 fused_moe_modular_method.py:89-111), so no call drops "
                  "it; 0.34.0 has no forward_impl_chunked."),
        remove_when=("finding 'dp_chunked_drops_flag' false on every supported release (0.11.1-"
                     "0.12.x no longer supported)."),
    ),),
    findings={"experts_call": Finding(experts_call, ("",) + EXPERTS_CALLS),
              "nvfp4_experts_weight_again": Finding(nvfp4_experts_weight_again),
              "dp_chunked_drops_flag": Finding(dp_chunked_drops_flag)},
    words=WORDS,
)
