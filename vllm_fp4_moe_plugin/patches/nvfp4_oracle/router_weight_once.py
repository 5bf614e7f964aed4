# SPDX-License-Identifier: Apache-2.0
"""Llama-4's router weight on the input counted once by the NVFP4 experts (vLLM 0.14.0+).

Why and how: the ledger entry (``patches/nvfp4_oracle``). With ``apply_router_weight_on_input``
(top-1: Llama-4), every prepare/finalize but the passthrough one scales the input by the router
weight before quantizing and dispatching it (v0.34.0 FM/prepare_finalize/no_dp_ep.py:74-80,
naive_dp_ep.py:185-190, flashinfer_nvlink_one_sided.py:113-118), and the NVFP4 experts weight
again: FlashInfer's CUTLASS, CuteDSL and B12X experts hand the kernel ``token_final_scales=
topk_weights`` for its output (FM/experts/flashinfer_cutlass_moe.py:375), vLLM's CUTLASS scales
its input by them a second time (FM/experts/cutlass_moe.py:612-617; vllm#43694, open). Where the
prepare applied the weight, the wrapper hands the experts unit weights, so the weight counts
exactly once whichever experts class runs; the finalize keeps the real weights (under the flag
it does not weight). Per MoE layer call it adds a flag lookup and the keyword re-pass, ~0.7 us
of host time (CPU, docs/VERIFICATION.md V84; none inside a replayed CUDA graph), and on Llama-4
layers one ``ones_like`` of ``[m, 1]``.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys

import torch

from vllm_fp4_moe_plugin.base.log import get_logger

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
    """``_fused_experts`` that hands NVFP4 experts unit weights where the prepare applied the
    router weight to the input."""
    sig = inspect.signature(original)

    @functools.wraps(original)
    def _fused_experts(self, *args, **kwargs):
        if args:  # vLLM calls it by keyword; anything else is bound once here
            call = sig.bind(self, *args, **kwargs)
            self, kwargs = call.arguments.pop("self"), call.arguments
        if not (kwargs.get("apply_router_weight_on_input") and weights_once(self)):
            return original(self, **kwargs)
        _log_once(self)
        return original(self, **{**kwargs, "topk_weights": torch.ones_like(kwargs["topk_weights"])})

    _fused_experts.__module__ = __name__
    return _fused_experts


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
