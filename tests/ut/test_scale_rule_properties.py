# SPDX-License-Identifier: Apache-2.0
"""The uncalibrated-scale rule (``scale_rule.judge`` / ``uncalibrated``) over generated layers:
a calibrated cluster (amax 0.01-1e4, spread up to 1000x, gate/up tuples or single values) with
0-100 % of the experts dead in every way quantizers leave them (NaN, inf, 0, negative, absurdly
small or large), in any order, judged whole and in EP slices of one or two experts.

What must hold: a value of the calibrated cluster is never flagged, whatever the dead fraction;
every dead value is; the verdict on an expert does not depend on which other experts are judged
with it (so every EP layout agrees); and two plausible clusters too far apart for one layer are
refused, never resolved by a guess."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_fp4_moe_plugin.scales import scale_rule
from vllm_fp4_moe_plugin.scales.scale_rule import (
    AMAX_MAX,
    AMAX_MIN,
    AMAX_PER_INPUT_SCALE,
    UNCALIBRATED_MARGIN,
    IndistinguishableScalesError,
    judge,
    uncalibrated,
)

K = AMAX_PER_INPUT_SCALE  # amax per input scale (2688)


@st.composite
def calibrated(draw, n, gate_up: bool):
    """``n`` experts' input scales around one layer's amax, spread at most 1000x."""
    center = draw(st.floats(min_value=0.01, max_value=1e4)) / K
    spread = st.floats(min_value=-1.5, max_value=1.5)  # log10, so 1000x end to end

    def one():
        return center * 10 ** draw(spread)

    return [(one(), one()) if gate_up else one() for _ in range(n)]


def _dead_value():
    return st.one_of(
        st.sampled_from([math.nan, math.inf, -math.inf, 0.0, -0.0]),
        st.floats(max_value=-1e-45, min_value=-1e38),                                # negative
        st.floats(min_value=1e-45, max_value=AMAX_MIN / K / 2),                       # tiny
        st.floats(min_value=AMAX_MAX / K * 2, max_value=3e38),                         # huge
    )


@st.composite
def layer(draw, gate_up: bool = False):
    """(input scales per expert, indices of the dead ones): 1-16 calibrated, 0-16 dead."""
    n_cal = draw(st.integers(min_value=1, max_value=16))
    n_dead = draw(st.integers(min_value=0, max_value=16))
    cal = draw(calibrated(n_cal, gate_up))
    dead = []
    for _ in range(n_dead):
        v = draw(_dead_value())
        if gate_up:  # one half dead, or both
            other = draw(st.one_of(_dead_value(), st.just(cal[0][0])))
            v = draw(st.sampled_from([(v, other), (other, v)]))
        dead.append(v)
    order = draw(st.permutations(list(range(n_cal + n_dead))))
    values = [None] * len(order)
    for pos, src in enumerate(order):
        values[pos] = cal[src] if src < n_cal else dead[src - n_cal]
    return values, {pos for pos, src in enumerate(order) if src >= n_cal}


@settings(max_examples=400, deadline=None)
@given(layer())
def test_calibrated_values_are_never_flagged_whatever_the_dead_fraction(case):
    values, dead = case
    assert set(uncalibrated(values)) == dead


@settings(max_examples=300, deadline=None)
@given(layer(gate_up=True))
def test_gate_and_up_each_judged(case):
    values, dead = case
    assert set(uncalibrated(values)) == dead


@settings(max_examples=300, deadline=None)
@given(layer(), st.integers(min_value=1, max_value=2), st.data())
def test_an_ep_slice_judges_each_expert_as_the_whole_layer_does(case, width, data):
    """What a compressed-tensors rank sees under EP (its local experts only)."""
    values, _ = case
    whole = judge(values)[0]
    start = data.draw(st.integers(min_value=0, max_value=max(0, len(values) - width)))
    part = judge(values[start:start + width])[0]
    assert part == {i - start: k for i, k in whole.items() if start <= i < start + width}


@settings(max_examples=300, deadline=None)
@given(layer())
def test_kinds_say_what_a_max_does_with_them(case):
    values, _ = case
    for i, kind in uncalibrated(values).items():
        v = values[i]
        if kind == "high":  # a max over experts would take it
            assert v != v or v * K > AMAX_MAX
        else:  # a max ignores it
            assert not v * K >= AMAX_MIN


@settings(max_examples=200, deadline=None)
@given(st.floats(min_value=AMAX_MIN, max_value=AMAX_MAX / UNCALIBRATED_MARGIN / 1.01),
       st.floats(min_value=1.01, max_value=1e6), layer())
def test_two_plausible_clusters_too_far_apart_are_refused(lo_amax, factor, case):
    """Nothing says which of them is calibrated: refused, with or without dead values beside."""
    hi_amax = min(lo_amax * UNCALIBRATED_MARGIN * factor, AMAX_MAX)
    values, _ = case
    dead_only = [v for i, v in enumerate(values) if i in case[1]]
    try:
        uncalibrated([lo_amax / K, hi_amax / K] + dead_only)
    except IndistinguishableScalesError:
        return
    raise AssertionError("two clusters more than the margin apart were not refused")


def test_the_window_holds_every_dead_value_quantizers_were_seen_to_write():
    """NVFP4-FORMAT §6's measured values, as input scales: all outside, the field inside."""
    ct_stored = [1.57e-29, 2.3e23, 4.9e23, 2.06e-19, 1.18e-38, 1.15e27, 1.01e21, 3.08e-41]
    modelopt_amax = [1e-29 * 50, 2.7e-37]
    for v in [1 / s for s in ct_stored] + [a / K for a in modelopt_amax]:
        assert not scale_rule.plausible(v), v
    for amax in (0.01, 1.0, 448.0, 2688.0, 1e4, 1e5):
        assert scale_rule.plausible(amax / K), amax
