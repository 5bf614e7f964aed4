# SPDX-License-Identifier: Apache-2.0
"""Llama-4's MoE (top-1, the router weight applied to the input, a shared expert) computed as
its model asks, on every release whose modular kernel the findings recognise: the whole patch
(its ledger entries, the findings they read, the wrappers). Each entry's ``why`` names what
vLLM gets wrong, with the source lines; docs/SUPPORT.md has the measured rows. Cost per MoE layer
call: a flag lookup (1.6-1.8 us of host time on an H100 host, none inside a replayed CUDA graph);
on Llama-4 layers one ``new_ones`` of ``[m, 1]`` and, where the prepare scales in place
(0.11.0-0.15.1), a copy of the input for the shared expert (benchmarks/RESULTS.md item 10)."""

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

# The modular kernel's method that hands the experts the router weights and the on-input flag,
# first match wins: 0.32.0+ (v0.34.0 FM/modular_kernel.py:1383-1475), 0.11.1-0.2x, 0.11.0 (v0110
# fused_moe/modular_kernel.py:723-855, called by keyword from forward, :971-986).
MODULAR_KERNEL = f"{vm.FUSED_MOE}.modular_kernel"
EXPERTS_CALLS = ("FusedMoEKernelModularImpl._fused_experts",
                 "FusedMoEModularKernel._fused_experts",
                 "FusedMoEModularKernel._maybe_chunk_fused_experts")
FUSED_EXPERTS_PARAMS = ("topk_weights", "apply_router_weight_on_input")
FUSED_MOE_LAYER = f"{vm.FUSED_MOE}.layer"  # FusedMoE, up to 0.27.x
# The modules of vLLM's prepare/finalize classes that a Llama-4 layer's kernel may hold
PREPARE_MODULES = (f"{vm.FUSED_MOE}.prepare_finalize", vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE)
_IN_PLACE = re.compile(r"\ba1\.mul_\(\s*topk_weights")
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


def _quant_dtype(kernel):
    return getattr(getattr(kernel.fused_experts, "quant_config", None), "quant_dtype", None)


def weights_once(kernel) -> bool:
    """NVFP4 experts behind a prepare that applied the weight (once per kernel object)."""
    known = getattr(kernel, "_fp4_moe_unit_weights", None)
    if known is None:
        known = (_quant_dtype(kernel) == "nvfp4"
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
        weights = kwargs["topk_weights"]
        return original(self, **{**kwargs, "topk_weights": weights.new_ones(weights.shape)})

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


_MISSING = object()


class _SharedOnInput:
    """The shared experts on the layer's input as it came, not the kernel's scaled ``a1``."""

    def __init__(self, shared, unweighted):
        self.shared, self.unweighted = shared, unweighted

    def __call__(self, _a1):
        return self.shared(self.unweighted)


def build_shared_input(original):
    """``FusedMoEModularKernel.forward`` that hands its shared experts the unweighted input
    where the router weight is applied on the input (Llama-4); every other call untouched."""
    flag_at = list(inspect.signature(original).parameters).index(
        "apply_router_weight_on_input") - 1  # its position among the arguments after self

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        flag = kwargs.get("apply_router_weight_on_input",
                          args[flag_at] if len(args) > flag_at else False)
        shared = getattr(self, "shared_experts", None) if flag else None
        if shared is None or _quant_dtype(self) != "nvfp4":  # FP8 & co.: not this plugin's
            return original(self, *args, **kwargs)
        hidden = args[0] if args else kwargs["hidden_states"]
        # an instance attribute shadows the submodule (nn.Module looks in _modules last)
        own = self.__dict__.get("shared_experts", _MISSING)
        self.__dict__["shared_experts"] = _SharedOnInput(shared, hidden.clone())
        try:
            return original(self, *args, **kwargs)
        finally:
            if own is _MISSING:
                del self.__dict__["shared_experts"]
            else:
                self.__dict__["shared_experts"] = own

    forward.__module__ = __name__
    return forward


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
    """Read from the source: do FlashInfer's CUTLASS experts weight the output whatever the flag
    (v0.34.0 FM/experts/flashinfer_cutlass_moe.py:252-375), or vLLM's CUTLASS FP4 scale its input
    again (FM/experts/cutlass_moe.py:612-617; vllm#43694)? Stock 0.11.0-0.34.0: the first."""
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


def prepare_scales_in_place() -> bool:
    """Read from the source: does one of vLLM's prepare/finalize modules scale its input by the
    router weight in place (``a1.mul_(topk_weights...)``: v0110 prepare_finalize.py:46, v0120
    flashinfer_cutlass_prepare_finalize.py:70; 0.34.0 scales a copy), in front of a
    ``FusedMoEModularKernel.forward`` that takes the on-input flag (the entry reads it there)?"""
    try:
        forward = original_attr(MODULAR_KERNEL, "FusedMoEModularKernel.forward")
    except (ImportError, AttributeError):
        return False
    if "apply_router_weight_on_input" not in inspect.signature(forward).parameters:
        return False
    for name in PREPARE_MODULES:
        module = _module_or_none(name)
        try:
            if module is not None and _IN_PLACE.search(inspect.getsource(module)):
                return True
        except (OSError, TypeError):
            continue
    return False


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


def shared_input_needed(findings) -> bool:
    """The kernel whose ``forward`` runs the shared experts on the prepare's input is
    ``FusedMoEModularKernel``, and a prepare scales that input in place."""
    return (str(findings.get("experts_call") or "").startswith("FusedMoEModularKernel.")
            and bool(findings.get("prepare_scales_in_place")))


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
        remove_when=("finding 'dp_chunked_drops_flag' false on every supported release (0.11.0-"
                     "0.12.x no longer supported)."),
    ), ModulePatch(
        module=MODULAR_KERNEL, attr="FusedMoEModularKernel.forward",
        build=f"{__name__}:build_shared_input", needed=shared_input_needed,
        why=("Llama-4's shared expert runs inside the modular kernel on the tensor the prepare "
             "got (v0110 fused_moe/modular_kernel.py:1001-1014), and the prepare scales it by "
             "the routed token's weight in place (v0110 prepare_finalize.py:46, v0120 "
             "flashinfer_cutlass_prepare_finalize.py:70): the shared expert computes on the "
             "weighted input."),
        how=("Wraps FusedMoEModularKernel.forward: with the on-input flag and shared experts, "
             "they are called on a copy of the layer's input taken before the prepare."),
        upstream=("None for 0.11.0-0.15.1, whose prepares scale in place (read from each "
                  "wheel: docs/data/release-probes.json); from 0.16.0 they scale a copy "
                  "(v0.34.0 FM/prepare_finalize/no_dp_ep.py:74-80)."),
        remove_when=("finding 'prepare_scales_in_place' false on every supported release."),
    ),),
    findings={"experts_call": Finding(experts_call, ("",) + EXPERTS_CALLS),
              "nvfp4_experts_weight_again": Finding(nvfp4_experts_weight_again),
              "dp_chunked_drops_flag": Finding(dp_chunked_drops_flag),
              "prepare_scales_in_place": Finding(prepare_scales_in_place)},
    words=WORDS,
)
