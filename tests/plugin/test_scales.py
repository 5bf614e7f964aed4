# SPDX-License-Identifier: Apache-2.0
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fp4_moe_plugin.scales import layer_scales, scale_agreement


@pytest.mark.parametrize("bad,kind", [(float("nan"), "NaN"), (float("inf"), "inf"),
                                      (0.0, "zero"), (-2.0, "negative")])
def test_bad_scale_names_layer_tensor_and_expert(bad, kind):
    t = torch.tensor([[1.0, 1.0], [0.5, 0.5], [2.0, bad]])
    with pytest.raises(layer_scales.InvalidScaleError) as err:
        layer_scales.check_positive_finite(t, layer="model.layers.3.mlp.experts",
                                     name="w13_input_scale")
    msg = str(err.value)
    assert "model.layers.3.mlp.experts" in msg and "'w13_input_scale'" in msg
    assert kind in msg and "expert index 2" in msg


def test_good_scales_pass():
    layer_scales.check_positive_finite(torch.tensor([1e-8, 3.0, 448.0]), layer="l", name="n")
    layer_scales.check_positive_finite(torch.tensor(2.0), layer="l", name="n")


def test_shared_scalar_rebuilds_alphas_exactly():
    gs = torch.tensor([100.0, 400.0, 250.0])
    ws2 = torch.tensor([0.01, 0.02, 0.03])
    g = scale_agreement.agree_min_scale(gs)  # no group: this rank only
    chosen = scale_agreement.shared_scalar_scales(g, ws2)
    assert chosen.shared and chosen.a1_gscale.dim() == 0
    assert float(chosen.a1_gscale) == 100.0
    # Reference check: alpha_e * g must reproduce each expert's weight scale.
    torch.testing.assert_close(chosen.g1_alphas * chosen.a1_gscale, ws2)


def test_per_expert_keeps_vectors():
    gs = torch.tensor([100.0, 400.0])
    alphas = torch.tensor([1e-4, 5e-5])
    chosen = scale_agreement.per_expert_scales(gs, alphas)
    assert not chosen.shared
    assert torch.equal(chosen.a1_gscale, gs) and torch.equal(chosen.g1_alphas, alphas)


# --- uncalibrated activation scales ----------------------------------------------------------
# What llmcompressor 0.14 wrote for an expert no calibration token reached: gate/up
# input_global_scale 1.57e-29, down_proj 0.0. A calibrated compressed-tensors scale is ~2688/amax.
LLMCOMPRESSOR_GATE_UP = 1.57e-29
LLMCOMPRESSOR_DOWN = 0.0


@pytest.fixture(autouse=True)
def _fresh_warning_state():
    layer_scales._reset_for_tests()
    yield
    layer_scales._reset_for_tests()


def test_margin_is_e4m3_normal_range():
    from vllm_fp4_moe_plugin.scales import scale_rule

    # Reference check: 448 (E4M3 max) over 2**-6 (E4M3 min normal).
    assert scale_rule.UNCALIBRATED_MARGIN == 448.0 * 64


# Input scales (amax / 2688): 1.0 is an amax of 2688, within what calibrations produce.
@pytest.mark.parametrize("amax,expected", [
    ([1.0, 1.3, 1.1, 0.9], []),                       # routed calibration spread
    ([1.0, 1.0, 1.0, 1.0], []),                       # all-experts calibration
    ([1.0, 50.0, 1.0, 1.0], []),                      # a legitimately rare, large expert
    ([1.0, 1.0, 1.0, 1.0, 1e3, 1e4], []),             # spreads far beyond any measured one
    ([1.0, 1e-3, 1.0, 1.0], []),                      # ... either way
    ([1.0, 2688 / LLMCOMPRESSOR_GATE_UP, 1.2], [1]),  # llmcompressor's no-statistics value
    ([1.0, float("inf"), 1.2], [1]),                  # a zero CT global scale, inverted
    ([1.0, float("nan"), 1.2], [1]),                  # uninitialised memory: anything at all
    ([1.0, -0.02, 1.2], [1]),                         # ... a negative value too
    ([1.0, 2688 / 2.3e23, 1.2], [1]),                 # ... or a huge global scale
    ([0.0, 1.0, 1.2], [0]),                           # a zero ModelOpt input_scale
    ([1.0, 1.0 * 28672 * 0.99], []),                  # a spread just inside the margin
    ([1e32, 1e32, 1.0, 1.0, 1.0], [0, 1]),            # dead values, whatever their number
    ([1e-33] * 4 + [1.0] * 4, [0, 1, 2, 3]),          # half the layer dead (routed calibration)
    ([1e-33] * 7 + [1.0], list(range(7))),            # ... or all but one expert
    ([1e-29, 0.9], [0]),                              # an EP rank's slice of two experts
    ([0.9], []), ([1e-29], [0]),                      # ... or of one
    ([(1.0, 1.1), (1.0, 1e-30), (1.2, 1.2)], [1]),    # gate and up judged each
])
def test_uncalibrated_experts(amax, expected):
    from vllm_fp4_moe_plugin.scales.scale_rule import uncalibrated_experts

    assert uncalibrated_experts(amax) == expected


@pytest.mark.parametrize("amax", [[1.0, 1.0 * 28672 * 1.01], [1e-4, 1e-4, 1e2, 1e2]])
def test_plausible_values_too_far_apart_are_refused_not_guessed(amax):
    from vllm_fp4_moe_plugin.scales.scale_rule import IndistinguishableScalesError, uncalibrated

    with pytest.raises(IndistinguishableScalesError, match="cannot be told apart") as err:
        uncalibrated(amax, where="model.layers.3.mlp.experts")
    assert "model.layers.3.mlp.experts" in str(err.value)


def test_uncalibrated_kinds_say_what_a_max_does_with_them():
    from vllm_fp4_moe_plugin.scales.scale_rule import uncalibrated

    # high: a max over experts takes it; low: a max ignores it.
    assert uncalibrated([1.0, float("inf"), float("nan"), 1e9, 0.0, -1.0, 1e-9]) == {
        1: "high", 2: "high", 3: "high", 4: "low", 5: "low", 6: "low"}


def test_activation_scales_only_get_their_dtype_checked():
    t = torch.tensor([[300.0, 300.0], [0.0, float("nan")], [-1.0, float("inf")]])
    layer_scales.check_positive_finite(t, layer="l", name="w13_input_global_scale", activation=True)
    for bad in (0.0, float("nan"), float("inf"), -1.0):  # weight scales: corruption, refused
        with pytest.raises(layer_scales.InvalidScaleError):
            layer_scales.check_positive_finite(torch.tensor([300.0, bad]), layer="l",
                                         name="w2_weight_global_scale")


def test_float8_scale_refused_naming_dtype_and_allowed_ones():
    t = torch.tensor([300.0, 200.0]).to(torch.float8_e4m3fn)
    with pytest.raises(layer_scales.InvalidScaleError) as err:
        layer_scales.check_positive_finite(t, layer="l", name="w2_input_global_scale",
                                           activation=True)
    assert "float8_e4m3fn" in str(err.value) and "float32" in str(err.value)


@pytest.mark.parametrize("dead", [LLMCOMPRESSOR_GATE_UP, LLMCOMPRESSOR_DOWN, -127.6, 2.3e23,
                                  float("nan")])
def test_repair_compressed_tensors_gives_calibrated_max_amax(dead, caplog_plugin):
    # compressed-tensors stores gs = 2688 / amax: the max amax is the MIN stored value.
    gs = torch.tensor([[300.0, 310.0], [250.0, 250.0], [dead, dead], [400.0, 400.0]])
    before = gs.clone()
    with caplog_plugin.at_level("INFO", logger="vllm.fp4_moe_plugin"):
        out = layer_scales.repair_uncalibrated(gs, reciprocal=True,
                                               layer="model.layers.1.mlp.experts",
                                               name="w13_input_global_scale")
    # Reference check: the calibrated experts' max amax is 2688/250; nothing else moves.
    assert out[2].tolist() == [250.0, 250.0]
    assert torch.equal(out[[0, 1, 3]], gs[[0, 1, 3]])
    torch.testing.assert_close(gs, before, rtol=0, atol=0, equal_nan=True)  # not in place
    warnings = [r for r in caplog_plugin.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "model.layers.1.mlp.experts" in msg and "expert(s) 2" in msg
    assert "w13_input_global_scale" in msg and "all-experts calibration" in msg


def test_repair_modelopt_and_amax_like():
    # ModelOpt's input_scale (and vLLM 0.14+'s a13_scale) is proportional to the amax.
    amax = torch.tensor([0.02, 0.0, 0.03, 0.025])
    out = layer_scales.repair_uncalibrated(amax, reciprocal=False, layer="l", name="a13_scale")
    assert out.tolist() == pytest.approx([0.02, 0.03, 0.03, 0.025])
    a13 = torch.tensor([0.02, 2688 / LLMCOMPRESSOR_GATE_UP, 0.03])
    assert layer_scales.repair_uncalibrated(a13, reciprocal=False, layer="l",
                                      name="a13_scale")[1] == pytest.approx(0.03)


def test_calibrated_scales_are_returned_as_is():
    gs = torch.tensor([[300.0, 310.0], [250.0, 250.0], [30.0, 30.0]])  # 10x: a rare expert
    assert layer_scales.repair_uncalibrated(gs, reciprocal=True, layer="l", name="n") is gs


def test_one_warning_per_process_later_layers_at_info(caplog_plugin):
    gs = torch.tensor([300.0, 0.0, 280.0])
    with caplog_plugin.at_level("INFO", logger="vllm.fp4_moe_plugin"):
        for i in range(3):
            layer_scales.repair_uncalibrated(gs, reciprocal=True,
                                             layer=f"model.layers.{i}.mlp.experts",
                                             name="w2_input_global_scale")
    levels = [r.levelname for r in caplog_plugin.records]
    assert levels == ["WARNING", "INFO", "INFO"]
    assert all(f"layers.{i}." in r.getMessage() for i, r in enumerate(caplog_plugin.records))


def test_strict_refuses_uncalibrated_with_requantize_advice(monkeypatch):
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "strict")
    with pytest.raises(layer_scales.UncalibratedScaleError) as err:
        layer_scales.repair_uncalibrated(torch.tensor([300.0, 0.0]), reciprocal=True, layer="l",
                                   name="w2_input_global_scale")
    assert "moe_calibrate_all_experts=True" in str(err.value)


def test_no_calibrated_expert_is_an_error():
    with pytest.raises(layer_scales.InvalidScaleError, match="nothing to fall back on"):
        layer_scales.repair_uncalibrated(torch.tensor([0.0, 0.0]), reciprocal=True, layer="l",
                                   name="w2_input_global_scale")


# --- the repair over generated layers --------------------------------------------------------
@settings(max_examples=150, deadline=None)
@given(st.floats(min_value=0.1, max_value=1e3),
       st.lists(st.floats(min_value=-1.5, max_value=1.5), min_size=1, max_size=8),
       st.lists(st.sampled_from([0.0, -127.6, 1.57e-29, 2.3e23, 1e-40, math.nan, math.inf]),
                max_size=8), st.booleans(), st.randoms(use_true_random=False))
def test_repair_keeps_every_calibrated_expert_bit_exact(center, spread, dead, reciprocal, rng):
    """Whatever fraction is dead: calibrated experts (amax within 1000x) come back as stored,
    bit for bit; every dead one carries the stored value of the calibrated expert with the
    largest amax."""
    amax = [center * 10 ** u for u in spread]
    cal = [(2688.0 / a) if reciprocal else a / 2688.0 for a in amax]
    if not reciprocal:
        dead = [1.0 / d if d not in (0.0, -127.6) and d == d and d != math.inf else d
                for d in dead]
    rows = [(v, False) for v in cal] + [(d, True) for d in dead]
    rng.shuffle(rows)
    stored = torch.tensor([v for v, _ in rows], dtype=torch.float32)
    out = layer_scales.repair_uncalibrated(stored, reciprocal=reciprocal, layer="l", name="n")
    kept = torch.tensor(cal, dtype=torch.float32)
    fallback = kept.min() if reciprocal else kept.max()
    for i, (_, is_dead) in enumerate(rows):
        assert out[i].item() == (fallback.item() if is_dead else stored[i].item())
