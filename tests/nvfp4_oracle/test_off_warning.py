# SPDX-License-Identifier: Apache-2.0
"""Plugin installed but off, on the oracle design (CI: vLLM 0.34.0): one WARNING per process where
stock can mix the EP ranks' scales (compressed-tensors under DP+EP with the default dispatch),
none elsewhere, none with VLLM_FP4_MOE_PLUGIN=0."""

import pytest

from fp4_moe_lab.simulation.layouts import LAYOUTS, spawn

pytestmark = pytest.mark.multiproc

JOB = "tests.layer_jobs:off_warning"


def test_dp_ep_warns_once_per_rank_and_names_the_audit():
    for rank in spawn(LAYOUTS["dp_ep_allgather"], JOB):
        for spread in ("4.0", "1.0"):  # one process cannot see the other ranks' scales
            warned = rank[f"unset/{spread}"]
            assert len(warned) == 1, warned
            assert "installed but off" in warned[0] and "DP+EP" in warned[0]
            assert "vllm-fp4-moe audit" in warned[0] and "--ep-size 2" in warned[0]
        assert rank["0/4.0"] == [] and rank["0/1.0"] == []


@pytest.mark.parametrize("layout", ["single", "tp_ep"])
def test_consistent_layouts_stay_silent(layout):
    for rank in spawn(LAYOUTS[layout], JOB):
        assert all(v == [] for v in rank.values()), rank
