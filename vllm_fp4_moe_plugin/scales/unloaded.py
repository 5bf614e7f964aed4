# SPDX-License-Identifier: Apache-2.0
"""Which experts' activation scales the checkpoint never provided.

vLLM creates an NVFP4 MoE layer's activation-scale parameters with ``torch.empty`` (v0110
Q/modelopt.py:1186-1194, v0.34.0 :1041-1058; compressed-tensors alike): an absent one (vllm#45212)
keeps whatever the memory held. With the plugin active they are filled with a sentinel NaN when
registered; after loading, :func:`missing_rows` names the experts still holding it, which the
repair treats as uncalibrated. A checkpoint with every tensor loads bit-identical to stock.
"""

from __future__ import annotations

import torch

from vllm_fp4_moe_plugin.base.param_watch import ParamWatch

ACTIVATION_SCALES = ("w13_input_scale", "w2_input_scale", "w13_input_global_scale",
                     "w2_input_global_scale")
# A quiet NaN (exponent all ones, top mantissa bit set) with the payload 0x0FEED: exporters
# write float32 NaN as 0x7FC00000 if at all, and arithmetic never produces this payload.
SENTINEL_BITS = 0x7FC0FEED
SENTINEL = torch.tensor([SENTINEL_BITS], dtype=torch.int32).view(torch.float32).item()


_should_fill = None  # set by watch(): does this layer's quant method repair what it loads?


def _on_parameter(module, name: str, param) -> None:
    if name not in ACTIVATION_SCALES or param.dtype != torch.float32:
        return
    if _should_fill is None or not _should_fill(module):  # left as stock leaves it
        return
    if "_fp4_moe_dummy_weights" not in module.__dict__:  # created inside vLLM's config context
        module.__dict__["_fp4_moe_dummy_weights"] = _dummy_load_format()
    if module.__dict__["_fp4_moe_dummy_weights"]:  # random values overwrite every tensor
        return
    seen = module.__dict__.setdefault("_fp4_moe_unloaded_filled", set())
    if name in seen:  # a re-registration after loading (process_weights_after_loading)
        return
    seen.add(name)
    with torch.no_grad():
        param.data.view(torch.int32).fill_(SENTINEL_BITS)


_watch = ParamWatch(_on_parameter)


def watch(should_fill) -> None:
    """Fill the activation-scale parameters of every layer ``should_fill`` says the plugin
    repairs after loading (elsewhere the sentinel would reach the kernel as NaN)."""
    global _should_fill
    _should_fill = should_fill
    _watch.install()


def remove() -> None:
    global _should_fill, _dummy_logged
    _watch.remove()
    _should_fill = None
    _dummy_logged = False


def repaired_by_plugin_class(layer) -> bool:
    """Pre-oracle designs: the layer's quant method is one of the plugin's classes, which
    repair every activation scale they load (``fp4_moe_repairs_activation_scales``)."""
    method = getattr(layer, "quant_method", None)
    return bool(getattr(type(method), "fp4_moe_repairs_activation_scales", False))


def any_layer(_layer) -> bool:
    """The oracle design: the wrapped oracle helpers repair every NVFP4 MoE layer's scales
    (Marlin, which does not pass through them, never reads activation scales)."""
    return True


def _dummy_load_format() -> bool:
    """Is vLLM building this model for ``--load-format dummy`` (random weights, no checkpoint;
    how vLLM's benchmarks run)? Read from the config vLLM sets while it constructs the model
    (``set_current_vllm_config``, v0110 model_loader/utils.py:60; the same in 0.34.0)."""
    import sys

    try:
        from vllm.config import get_current_vllm_config
    except ImportError:
        return False
    config = getattr(sys.modules.get(get_current_vllm_config.__module__), "_current_vllm_config",
                     None)
    fmt = getattr(getattr(config, "load_config", None), "load_format", None)
    return str(getattr(fmt, "value", fmt)).lower() == "dummy"


_dummy_logged = False


def dummy_weights(layer) -> bool:
    """Was ``layer`` loaded with vLLM's dummy weights? Then there is no checkpoint scale to
    check or repair: the plugin leaves every value as vLLM set it (one INFO per process)."""
    global _dummy_logged
    if not layer.__dict__.get("_fp4_moe_dummy_weights"):
        return False
    if not _dummy_logged:
        _dummy_logged = True
        from vllm_fp4_moe_plugin.base.log import get_logger

        get_logger("unloaded").info(
            "vllm-fp4-moe-plugin: --load-format dummy: the weights are random, not a "
            "checkpoint's, so no NVFP4 scale is checked or repaired (the layers are served as "
            "vLLM set them)")
    return True


def missing_rows(stored: torch.Tensor) -> list[int]:
    """The experts (rows of ``stored``: one layer's activation scales, ``[E]`` or ``[E, k]``)
    with at least one entry the checkpoint did not write."""
    t = stored.detach()
    if t.dtype != torch.float32 or t.numel() == 0:
        return []
    hit = t.contiguous().view(torch.int32) == SENTINEL_BITS
    hit = hit.reshape(t.shape[0] if t.dim() else 1, -1).any(dim=1)
    return [int(i) for i in torch.nonzero(hit).flatten().tolist()]
