# SPDX-License-Identifier: Apache-2.0
"""The fleet check's decision table, without processes: every mix of rank kinds (switch on,
``0``, unset, no plugin) over three ranks. A rank without the plugin computes as stock, like one
that is off: only a fleet in which some rank runs the fix must be uniform. What a rank's pipeline
stage holds is not an input at all (the check runs at vLLM's distributed initialisation, before
any layer exists); test_fleet.py shows that on real process groups.
"""

from __future__ import annotations

import itertools

import pytest

from vllm_fp4_moe_plugin.patches.fleet import (
    AGREED_ON,
    INCOMPLETE,
    MISMATCH,
    STOCK,
    RankState,
    decide,
    disagreement,
)

KINDS = ("on", "zero", "unset", "absent")


def state(rank: int, kind: str, **kw) -> RankState:
    if kind == "on":
        return RankState(rank, "0.1.0", "nvfp4_oracle", "active", "1", **kw)
    return RankState(rank, "0.1.0", "", "off", "0" if kind == "zero" else "unset", **kw)


def expected(kinds) -> str:
    """The rule, written independently of decide(): stock unless some rank is on; then every
    rank must be on."""
    if "on" not in kinds:
        return STOCK
    if any(k in ("zero", "unset") for k in kinds):
        return MISMATCH
    return INCOMPLETE if "absent" in kinds else AGREED_ON


@pytest.mark.parametrize("kinds", list(itertools.product(KINDS, repeat=3)),
                         ids="-".join)
def test_every_mix_of_three_ranks(kinds):
    states = {r: state(r, k) for r, k in enumerate(kinds) if k != "absent"}
    verdict, message = decide(states, world=3)
    assert verdict == expected(kinds)
    assert (message is None) == (verdict in (STOCK, AGREED_ON))


def test_off_ranks_that_differ_in_version_serve_as_stock():
    """Off everywhere: nothing of the plugin runs, so its version does not matter."""
    states = {0: state(0, "unset"), 1: RankState(1, "0.0.9", "", "off", "0")}
    assert decide(states, world=3) == (STOCK, None)


def test_a_missing_rank_next_to_ranks_that_run_the_fix_is_named_with_the_fix():
    verdict, message = decide({0: state(0, "on"), 2: state(2, "on")}, world=3)
    assert verdict == INCOMPLETE
    assert "rank(s) 1 of the 3 ranks" in message
    assert "VLLM_PLUGINS without fp4_moe" in message and "install the same" in message
    assert "unset VLLM_FP4_MOE_PLUGIN everywhere" in message
    assert message.count("active (VLLM_FP4_MOE_PLUGIN=1)") == 2


def test_an_off_rank_next_to_an_on_rank_names_both_and_the_missing_one():
    verdict, message = decide({0: state(0, "on"), 1: state(1, "unset")}, world=3)
    assert verdict == MISMATCH
    assert "active (VLLM_FP4_MOE_PLUGIN=1): rank 0" in message
    assert "plugin 0.1.0, off (VLLM_FP4_MOE_PLUGIN unset): rank 1" in message
    assert "rank(s) 2 of the 3: never reported" in message
    assert "Fix: Set VLLM_FP4_MOE_PLUGIN to the same value" in message
    # an off rank does not probe vLLM: its empty design is not a difference to fix
    assert "Install the same vLLM release" not in message


def test_workers_turned_off_by_their_own_environment_are_refused_even_all_off():
    """Launched by a process with the switch on (Ray nodes started with =0): the operator asked
    for the fix, and no rank runs it."""
    states = {r: state(r, "zero", launcher_on=True) for r in (0, 1)}
    verdict, message = decide(states, world=2)
    assert verdict == MISMATCH
    assert "ranks 0, 1: started by a process with VLLM_FP4_MOE_PLUGIN=1" in message


def test_fixes_name_only_what_differs():
    on = state(0, "on")
    assert disagreement([on, state(1, "on")]) is None
    msg = disagreement([on, RankState(1, "0.2.0", "modular_method", "active", "1")])
    assert "Install the same vllm-fp4-moe-plugin version" in msg
    assert "Install the same vLLM release" in msg and "Set VLLM_FP4_MOE_PLUGIN" not in msg
    inactive = RankState(1, "0.1.0", "unknown", "inactive", "1", reason="test: unknown design")
    msg = disagreement([on, inactive])
    assert "inactive: test: unknown design" in msg and "Install the same vLLM release" in msg
