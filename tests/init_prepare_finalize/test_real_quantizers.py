# SPDX-License-Identifier: Apache-2.0
"""llmcompressor's dead experts (uninitialised input scales) on real vLLM 0.11.0 layers: the
plugin at the ideal NVFP4 answer with one WARNING naming them, stock far off."""

import pytest

from tests import real_quantizer_checks as checks

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_dead_experts_of_a_real_routed_checkpoint():
    from fp4_moe_lab.simulation.uncalibrated import run_checkpoint

    checks.check_dead_rows(run_checkpoint(checks.DEAD, checks.LAYERS, ("single",)))
