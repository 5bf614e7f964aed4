# SPDX-License-Identifier: Apache-2.0
"""The consistency matrix on the installed 0.11.1-era release (CI: vLLM 0.12.0).

On the holes upstream left, stock is wrong (or cannot run) and the plugin is within NVFP4 noise;
everywhere else the plugin is inert, so its output is bit-identical to stock's. The fixture has
per-expert input scales spread 4x (different for every expert and for w13 vs w2), else no hole
could show.
"""

import pytest

from fp4_moe_lab.simulation.layouts import LAYOUT_NAMES, Scenario
from fp4_moe_lab.simulation.matrix import rows_for_layout
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

# (format, layout) pairs where stock 0.11.1-0.13.0 is inconsistent: docs/ROOT-CAUSE.md §7 items 1-2.
HOLES = {("compressed-tensors", "dp_ep_allgather"), ("compressed-tensors", "dp_ep_all2allv"),
         ("compressed-tensors", "dp"), ("modelopt", "tp_all2allv"),
         ("compressed-tensors", "tp_all2allv")}

_rows: dict = {}


def _row(layout: str, fmt: str):
    if layout not in _rows:
        _rows[layout] = {r.format: r for r in rows_for_layout(layout, Scenario())}
    return _rows[layout][fmt]


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_holes_fixed_and_everything_else_untouched(layout, fmt):
    row = _row(layout, fmt)
    assert row.design == "modular_method"
    assert row.plugin_error is None, row.plugin_error
    # Reference check: the plugin sits at the ideal NVFP4 answer of this release's scheme and at
    # the noise floor from fp32, on every rank.
    assert row.plugin_rel_err <= PLUGIN_BOUND, row
    assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
    if (fmt, layout) in HOLES:
        assert row.stock_error or row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
        assert row.stock_error or row.stock_fp32_err >= 2 * row.noise_floor, row
        assert not row.bit_identical
        if fmt == "compressed-tensors":  # our subclass runs the load-time check on every rank
            assert all(row.plugin_check), row.plugin_check
        else:  # ModelOpt stays vLLM's own class on this design: nothing of ours runs there
            assert not any(row.plugin_check), row.plugin_check
    else:
        assert row.bit_identical, f"the plugin changed an upstream-fixed path: {row}"
        assert row.stock_error is None and not row.stock_affected
    assert row.ok


def test_tp_all2allv_stock_fails_loudly_not_silently():
    """Upstream's shape check (fi 0.5.3 fused_moe/core.py:866-873) stops stock at the first
    forward: the hole is an outage, not wrong tokens."""
    row = _row("tp_all2allv", "modelopt")
    assert row.stock_error and "Invalid shape of output" in row.stock_error
