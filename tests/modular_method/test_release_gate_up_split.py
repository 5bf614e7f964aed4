# SPDX-License-Identifier: Apache-2.0
"""Gate and up with their own weight global scales on vLLM 0.12.0 (modular_method design): stock
reads the up half with the gate's scale, the plugin carries each expert's factor in GEMM2's
scales (what and why: tests/init_prepare_finalize/test_gate_up_split.py)."""

import pytest

from fp4_moe_lab.simulation.layouts import Scenario
from fp4_moe_lab.simulation.matrix import run_matrix
from tests.gate_up_checks import check_split_rows

pytestmark = [pytest.mark.multiproc]


@pytest.mark.parametrize("split", [4.0])
def test_split_gate_up_scales_stock_wrong_plugin_at_noise(split):
    check_split_rows(run_matrix(layouts=("dp_ep_allgather",),
                                scenario=Scenario(gate_up_split=split)))
