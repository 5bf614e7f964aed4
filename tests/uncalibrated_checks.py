# SPDX-License-Identifier: Apache-2.0
"""What every release world's suite asserts about uncalibrated experts, one copy.

Each world runs ``simulation.uncalibrated.run_uncalibrated`` on its own vLLM (real layers, real
gloo ranks) and hands the rows here. The plugin must load the uncalibrated expert at the
calibrated experts' max amax (at the ideal reference of that layer, warned, naming expert 1),
leave a legitimately large expert alone, and stock must do what the support model says it does
with such an expert on that release: wrong far above NVFP4 noise, or bit-identical.
"""

import math

from tests.pass_marks import AFFECTED_FACTOR, PLUGIN_BOUND
from vllm_fp4_moe_plugin.base import support

# What CI runs per layout: llmcompressor's two values (gate/up 1.57e-29, down_proj 0.0) and the
# rare expert that must stay untouched; docs/data/uncalibrated-*.json hold every planted case.
CI_PLANTS = (("w13", "tiny"), ("w2", "zero"), ("w13", "large"), ("w13", "missing"))
LAYOUTS = ("single", "dp_ep_allgather")
PLANTED_EXPERT = 1  # the fixture's experts share one amax: planted_scales picks expert 0 ^ 1


def kind(fmt: str, case: str) -> str:
    """The support model's word for what stock loads for the planted expert: ``high`` or
    ``low`` by the uncalibrated rule applied to that amax next to a calibrated one (a ModelOpt
    0 is a low amax; a compressed-tensors 0, 1 / 0 = inf, a high one; a missing tensor is what
    the memory held)."""
    from fp4_moe_lab.simulation.planted_scales import CASES, MISSING, MISSING_MEMORY
    from vllm_fp4_moe_plugin.scales.scale_rule import uncalibrated

    stored = CASES[case].stored(fmt)
    stored = MISSING_MEMORY if stored == MISSING else stored
    if fmt == "compressed-tensors":
        amax = math.inf if stored == 0 else 1.0 / stored
    else:
        amax = stored
    return uncalibrated([1.0, 1.0, 1.0, amax])[3]


def check_row(row: dict, design) -> None:
    where = f"{row['format']}/{row['layout']}/{row['gemm']} {row['case']}"
    if not support.plugin_repairs_uncalibrated(design, row["format"]):
        # The documented gap (ModelOpt on 0.11.1 - 0.13.0): the plugin is inert there, and stock
        # does what the support model says.
        assert row["bit_identical"] and row["plugin_warnings"] == [], where
        wrong = row["case"] != "large" and support.stock_wrong_with_uncalibrated(
            design, row["format"], [kind(row["format"], row["case"])])
        assert stock_wrong(row) is wrong, (where, row)
        return
    # Reference check: the ideal NVFP4 output of the layer whose uncalibrated expert carries
    # the calibrated experts' max amax (ModelOpt's exporter rule), from the same seeds.
    assert row["plugin_error"] is None, where
    assert row["plugin_rel_err"] <= PLUGIN_BOUND, (where, row["plugin_rel_err"])
    # the matrix's rule wants stock far off or bit-identical; a negative scale's damage on the
    # per-expert designs is real but smaller (stock_wrong)
    assert row["ok"] or stock_wrong(row), where
    if row["case"] == "large":  # calibrated, merely rare: never touched, never warned about
        assert row["plugin_warnings"] == [], where
        return
    assert any(f"expert(s) {PLANTED_EXPERT} (" in w for w in row["plugin_warnings"]), \
        (where, row["plugin_warnings"])
    if row["case"] == "missing":  # known as absent, not guessed from what the memory held
        assert any(f"expert(s) {PLANTED_EXPERT} (missing from the checkpoint)" in w
                   for w in row["plugin_warnings"]), (where, row["plugin_warnings"])
    if support.stock_wrong_with_uncalibrated(design, row["format"],
                                             [kind(row["format"], row["case"])]):
        assert stock_wrong(row), (where, row)
    else:
        assert row["bit_identical"], where


def stock_wrong(row: dict) -> bool:
    """Stock far above NVFP4 noise; or, for a negative scale, measurably off: where 0.11.x keeps
    per-expert scales, the sign of a negative input scale cancels between the activation's
    quantization and the expert's alpha, so only its magnitude is wrong (measured 0.03-0.06
    against the plugin's 0.002)."""
    if row["stock_rel_err"] >= AFFECTED_FACTOR * PLUGIN_BOUND:
        return True
    return (row["case"] == "negative" and not row["bit_identical"]
            and row["stock_rel_err"] >= 10 * row["plugin_rel_err"])


def world_tests(design, layouts: tuple):
    """(fixture ``rows``, test) for one release world's suite: the CI plants in ``layouts`` on
    the installed vLLM, every row held to :func:`check_row` for ``design``. Each world's module
    binds both at module level (pytest collects them there)."""
    import pytest

    @pytest.fixture(scope="module")
    def rows():
        from fp4_moe_lab.simulation.uncalibrated import run_uncalibrated

        return {(r["format"], r["layout"], r["gemm"], r["case"]): r
                for r in run_uncalibrated(layouts, CI_PLANTS)}

    @pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
    @pytest.mark.parametrize("layout", layouts)
    @pytest.mark.parametrize("plant", CI_PLANTS)
    def test_uncalibrated_expert(rows, fmt, layout, plant):
        check_row(rows[(fmt, layout, *plant)], design)

    return rows, test_uncalibrated_expert


# Half a layer uncalibrated (llmcompressor's values): under EP=2 one rank holds only dead experts
MANY_DEAD = 4
MANY_DEAD_PLANTS = (("w13", "tiny", MANY_DEAD), ("w2", "zero", MANY_DEAD))
MANY_DEAD_LAYOUTS = ("dp_ep_allgather",)  # the whole layer on one rank is the same rule


def check_many_dead_row(row: dict, design) -> None:
    """Half the experts dead: the plugin loads every one of them, and only them, at the
    calibrated experts' max amax (the ideal reference), never a calibrated expert at a dead
    value (the layer would output nothing); stock is far off where the support model says so,
    else the plugin is bit-identical to it; where the plugin does not repair
    (the documented ModelOpt gap on 0.11.1-0.13.0) it is inert."""
    import re

    where = f"{row['format']}/{row['layout']}/{row['gemm']} {row['case']} x{row['count']}"
    if not support.plugin_repairs_uncalibrated(design, row["format"]):
        assert row["bit_identical"] and row["plugin_warnings"] == [], where
        return
    assert row["plugin_error"] is None, where
    assert row["plugin_rel_err"] <= PLUGIN_BOUND, (where, row["plugin_rel_err"])
    assert row["plugin_output"] == "finite", where
    # one WARNING per rank that loads dead scales (ModelOpt: every rank loads every expert's),
    # each naming the dead experts and no calibrated one
    assert row["plugin_warnings"], where
    for w in row["plugin_warnings"]:
        assert len(re.findall(r"\b\d+ \((?:high|low)\b", w)) == row["count"], (where, w)
    if support.stock_wrong_with_uncalibrated(design, row["format"],
                                             [kind(row["format"], row["case"])]):
        assert stock_wrong(row), (where, row["stock_rel_err"])
    else:  # e.g. a GEMM2 scale vLLM collapses to the experts' max: the dead zeros drop out
        assert row["bit_identical"], (where, row["stock_rel_err"])


def many_dead_tests(design):
    """(fixture, test) as :func:`world_tests`, for half a layer uncalibrated."""
    import pytest

    @pytest.fixture(scope="module")
    def many_dead_rows():
        from fp4_moe_lab.simulation.uncalibrated import run_uncalibrated

        return {(r["format"], r["layout"], r["gemm"]): r
                for r in run_uncalibrated(MANY_DEAD_LAYOUTS, MANY_DEAD_PLANTS)}

    @pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
    @pytest.mark.parametrize("layout", MANY_DEAD_LAYOUTS)
    @pytest.mark.parametrize("gemm", [p[0] for p in MANY_DEAD_PLANTS])
    def test_half_the_layer_uncalibrated(many_dead_rows, fmt, layout, gemm):
        check_many_dead_row(many_dead_rows[(fmt, layout, gemm)], design)

    return many_dead_rows, test_half_the_layer_uncalibrated


def check_bad_scale_row(row: dict, kind: str, value: str) -> None:
    """One planted bad global scale at expert 3 (tests/layer_jobs.py ``bad_scales``): stock
    loads it silently; the plugin refuses a bad *weight* scale naming layer, tensor and expert,
    and loads any activation scale no calibration produced (NaN, inf, 0, negative: what
    llmcompressor writes for an uncalibrated expert) with the calibrated experts' max amax."""
    assert row["stock"] is None  # stock loads it silently
    msg = row["plugin"]
    if kind != "weight":
        assert msg is None, msg
        return
    kind_word = {"nan": "NaN", "inf": "inf", "zero": "zero", "negative": "negative"}[value]
    assert msg is not None and msg.startswith("InvalidScaleError"), msg
    assert row["layer"] in msg and repr(row["param"]) in msg
    assert kind_word in msg and "expert index 3" in msg
