# SPDX-License-Identifier: Apache-2.0
"""Gate and up with their own weight global scales (published GLM exports: up to 10x), on real
vLLM layers: stock reads the up half with the gate's scale (every release, both formats), the
plugin carries each expert's factor in GEMM2's scales (``gate_up.py``).

The layer is quantized as such exports are (each half from its own amax, the up masters up to
``split`` times the gate's); the references compute what the checkpoint means. Stock is far above
NVFP4 noise; the plugin is at it: its error against the fp32 answer is the ideal kernel's, and
it differs from the ideal NVFP4 realization only where GEMM1's bf16 output rounds ``r * up``
instead of ``up`` (CUTLASS; TRT-LLM requantizes from fp32)."""

import pytest

from fp4_moe_lab.simulation.layouts import Scenario
from fp4_moe_lab.simulation.matrix import run_matrix
from tests.gate_up_checks import check_split_rows

pytestmark = [pytest.mark.multiproc]


@pytest.mark.parametrize("split", [10.0])
def test_split_gate_up_scales_stock_wrong_plugin_at_noise(split):
    check_split_rows(run_matrix(layouts=("single", "dp_ep_allgather"),
                                scenario=Scenario(gate_up_split=split)))
