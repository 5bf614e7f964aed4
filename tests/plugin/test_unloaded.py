# SPDX-License-Identifier: Apache-2.0
"""Activation scales a checkpoint does not provide are known, not guessed (vllm#45212: ModelOpt
exports that omit the input_scale of experts no calibration token reached; vLLM leaves the
parameter as torch.empty left it)."""

import math

import pytest
import torch

from vllm_fp4_moe_plugin.scales import layer_scales, unloaded


class Method:
    fp4_moe_repairs_activation_scales = True


@pytest.fixture
def watching():
    unloaded.watch(unloaded.repaired_by_plugin_class)
    yield
    unloaded.remove()


_METHOD = Method()


def _layer(method=_METHOD, init=torch.empty) -> torch.nn.Module:
    layer = torch.nn.Module()
    layer.quant_method = method
    layer.register_parameter("w13_input_scale", torch.nn.Parameter(
        init(4, 2), requires_grad=False))
    return layer


def test_a_plausible_leftover_is_still_found_missing(watching):
    """Whatever the memory held, the entries the loader never wrote are named; a loaded NaN
    (llm-compressor #2826's value) is not 'missing' but still uncalibrated."""
    layer = _layer()
    loaded = {0: (0.5, 0.5), 1: (math.nan, math.nan), 3: (0.4, 0.4)}  # expert 2 is absent
    for e, (gate, up) in loaded.items():
        layer.w13_input_scale.data[e] = torch.tensor([gate, up])
    layer.w13_input_scale.data[2, 1] = 0.45  # only its up scale arrived: still missing
    assert unloaded.missing_rows(layer.w13_input_scale.data) == [2]
    fixed = layer_scales.repair_uncalibrated(
        layer.w13_input_scale.data, reciprocal=False, layer="L", name="w13_input_scale",
        missing=tuple(unloaded.missing_rows(layer.w13_input_scale.data)))
    assert fixed[2].tolist() == [0.5, 0.5] and fixed[1].tolist() == [0.5, 0.5]


def test_only_layers_the_plugin_repairs_and_only_at_creation(watching):
    """A quant method that does not repair keeps stock's parameter; a re-registration after
    loading (process_weights_after_loading) is never overwritten."""
    # zeros, not torch.empty: freed memory may still hold an earlier test's sentinel
    stock = _layer(method=object(), init=torch.zeros)
    assert unloaded.missing_rows(stock.w13_input_scale.data) == []
    assert not stock.w13_input_scale.data.any()  # left exactly as created
    layer = _layer()
    assert unloaded.missing_rows(layer.w13_input_scale.data) == [0, 1, 2, 3]
    layer.w13_input_scale = torch.nn.Parameter(torch.ones(4, 2), requires_grad=False)
    assert unloaded.missing_rows(layer.w13_input_scale.data) == []


def test_the_sentinel_is_a_nan_no_exporter_writes():
    assert math.isnan(unloaded.SENTINEL)
    assert unloaded.missing_rows(torch.full((3,), math.nan)) == []  # float32 NaN 0x7FC00000
    assert unloaded.missing_rows(torch.full((3,), math.nan) * 2.0) == []


def test_off_fills_nothing():
    layer = _layer()
    layer.w13_input_scale.data.fill_(1.0)
    assert unloaded.missing_rows(layer.w13_input_scale.data) == []


def test_a_layer_without_any_activation_scale_is_refused():
    """vllm#54189: a weight-only checkpoint has no input scale for any expert; there is no
    calibrated expert to fall back on, so the load stops with a message, not zeros."""
    stored = torch.full((4,), unloaded.SENTINEL)
    with pytest.raises(layer_scales.InvalidScaleError, match="no expert of this layer"):
        layer_scales.repair_uncalibrated(stored, reciprocal=False, layer="L", name="w2_input_scale",
                                   missing=tuple(unloaded.missing_rows(stored)))


@pytest.mark.parametrize("load_format", ["dummy", "auto"])
def test_dummy_weights_are_neither_checked_nor_repaired(watching, load_format, caplog_plugin,
                                                       monkeypatch):
    """``--load-format dummy``: vLLM fills every tensor with random values in [-1e-3, 1e-3]
    (about half the scales negative). Created while vLLM's current config names that format
    (the engine sets it around model construction; tests/engine runs the real one), the layer
    is served as vLLM set it (one INFO); with a real format the same values are refused."""
    import sys
    from types import SimpleNamespace

    from vllm.config import get_current_vllm_config

    config = SimpleNamespace(load_config=SimpleNamespace(load_format=load_format))
    monkeypatch.setattr(sys.modules[get_current_vllm_config.__module__], "_current_vllm_config",
                        config)
    layer = _layer()
    for name, shape in (("w13_weight_scale_2", (4, 2)), ("w2_weight_scale_2", (4,)),
                        ("w2_input_scale", (4,))):
        layer.register_parameter(name, torch.nn.Parameter(torch.empty(shape),
                                                          requires_grad=False))
    g = torch.Generator().manual_seed(0)
    for p in layer.parameters():  # what vLLM's dummy loader does
        p.data.uniform_(-1e-3, 1e-3, generator=g)
    before = [p.detach().clone() for p in layer.parameters()]
    if load_format == "auto":
        with pytest.raises(layer_scales.InvalidScaleError, match="negative"):
            layer_scales.check_weight_scales(layer, "modelopt")
        return
    with caplog_plugin.at_level("INFO", logger="vllm.fp4_moe_plugin"):
        layer_scales.check_weight_scales(layer, "modelopt")
        layer_scales.repair_activation_scales(layer, "modelopt")
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    assert [r.getMessage() for r in caplog_plugin.records if "dummy" in r.getMessage()]
