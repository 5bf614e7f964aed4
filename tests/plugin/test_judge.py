# SPDX-License-Identifier: Apache-2.0
"""The one rule every matrix row is judged by (simulation/judge.py), on hand-made outputs."""

import pytest
import torch

from fp4_moe_lab.simulation import judge
from fp4_moe_lab.simulation.layouts import RankOutput
from tests import pass_marks

IDEAL = torch.ones(4, 8)
FP32 = IDEAL * (1 + 1e-3)  # a noise floor of 1e-3
INFO = {"prepare_finalize": "X", "a1_gscale_shape": [1]}


def _rank(stock, plugin, error=None):
    r = RankOutput(rank=0, dp_rank=0, info={"modelopt/plugin": INFO})
    for mode, out in (("stock", stock), ("plugin", plugin)):
        if out is None:
            r.errors[f"modelopt/{mode}"] = error
        else:
            r.outputs[f"modelopt/{mode}"] = out
    return r


def _row(rank):
    return judge.judge("modelopt", "tp", "flashinfer_cutlass", [rank], lambda r: (IDEAL, FP32),
                       scheme="per_expert", release=("0.0.0", None))


def test_the_codes_marks_are_no_looser_than_the_tests():
    assert judge.PLUGIN_BOUND <= pass_marks.PLUGIN_BOUND
    assert judge.FP32_FACTOR <= pass_marks.FP32_FACTOR
    assert judge.AFFECTED_FACTOR >= pass_marks.AFFECTED_FACTOR


@pytest.mark.parametrize("stock_off, plugin_off, affected, identical, ok", [
    (0.0, 0.0, False, True, True),      # no hole: bit-identical, both at the ideal
    (0.5, 0.0, True, False, True),      # a hole the plugin fixes
    (0.5, 0.5, True, True, False),      # a hole the plugin does not fix
    (0.0, 5e-4, False, False, False),   # no hole, but the plugin changed the output
    (0.05, 0.0, False, False, False),   # stock off, but not clearly a hole: must be identical
])
def test_ok_rule(stock_off, plugin_off, affected, identical, ok):
    row = _row(_rank(IDEAL * (1 + stock_off), IDEAL * (1 + plugin_off)))
    assert (row.stock_affected, row.bit_identical, row.ok) == (affected, identical, ok)
    assert row.noise_floor == pytest.approx(1e-3, rel=1e-3)


def test_a_stock_answer_as_accurate_as_nvfp4_is_ok_only_where_the_caller_accepts_it():
    """A planted expert the plugin repairs: stock off the reference (0.05) but no further from
    fp32 than NVFP4's own noise (the reference is the fp32 one here)."""
    rank = _rank(IDEAL * 1.05, IDEAL)
    strict = judge.judge("modelopt", "tp", "flashinfer_cutlass", [rank],
                         lambda r: (IDEAL, IDEAL * 1.05), scheme="per_expert",
                         release=("0.0.0", None))
    accepting = judge.judge("modelopt", "tp", "flashinfer_cutlass", [rank],
                            lambda r: (IDEAL, IDEAL * 1.05), scheme="per_expert",
                            release=("0.0.0", None), equally_accurate_ok=True)
    assert not strict.ok and accepting.ok and not accepting.stock_affected


def test_a_layer_that_cannot_run_is_a_row_with_its_error():
    row = _row(_rank(None, IDEAL, error="RuntimeError: shape"))
    assert row.stock_error == "RuntimeError: shape" and row.stock_rel_err == float("inf")
    assert row.stock_affected and row.ok and not row.bit_identical


def _both_fail(stock_error, plugin_error):
    r = RankOutput(rank=0, dp_rank=0, info={"modelopt/plugin": INFO},
                   errors={"modelopt/stock": stock_error, "modelopt/plugin": plugin_error})
    return _row(r)


def test_vllm_refusing_the_backend_alike_is_a_row_not_a_hole():
    """vLLM's backend selection refusing the layout (0.15.0: FlashInfer CUTLASS at DP=2 without
    EP) with and without the plugin: ok, no hole; any other shared failure, or a refusal only
    with the plugin, is not ok."""
    said = judge.REFUSED + "NvFp4 MoE backend 'FLASHINFER_CUTLASS' does not support ..."
    refused = _both_fail(said, said)
    assert refused.ok and refused.vllm_refuses and not refused.stock_affected
    both_crash = _both_fail("RuntimeError: shape", "RuntimeError: shape")
    assert not both_crash.ok and not both_crash.vllm_refuses
    plugin_only = _both_fail(said, judge.REFUSED + "another reason")
    assert not plugin_only.ok and not plugin_only.vllm_refuses


def test_only_vllms_backend_selection_counts_as_a_refusal():
    from fp4_moe_lab.simulation.layouts import refusal

    def select_nvfp4_moe_backend():  # named as vLLM's oracle function
        raise ValueError("kernel does not support parallel config")

    with pytest.raises(ValueError) as err:
        select_nvfp4_moe_backend()
    assert refusal(err.value).startswith(judge.REFUSED)
    with pytest.raises(ValueError, match="elsewhere"):
        refusal(ValueError("elsewhere"))  # a harness gap is re-raised


def test_a_modelled_hole_needs_only_stock_outside_the_bound():
    """Where the support model predicts a hole whatever the scales (vLLM's CUTLASS under EP),
    stock outside the bound is enough for the plugin to change it; within it, still identical."""
    def row(stock_off, plugin_off):
        return judge.judge("modelopt", "tp_ep", "vllm_cutlass",
                           [_rank(IDEAL * (1 + stock_off), IDEAL * (1 + plugin_off))],
                           lambda r: (IDEAL, FP32), scheme="per_expert",
                           release=("0.0.0", None), modelled_hole=True)
    assert row(0.05, 0.0).ok and not row(0.05, 0.0).stock_affected
    assert not row(0.005, 0.0).ok  # stock within the bound: the plugin must leave it alone
    assert not row(0.05, 0.05).ok  # the plugin must be right
