# SPDX-License-Identifier: Apache-2.0
"""Uncalibrated experts on real layers of vLLM 0.12.0 (modular_method design).

DP=2+EP, where the plugin's EP agreement must not carry the value to every rank, runs on the
newest design; the published docs/data/uncalibrated-vllm-*.json hold it for every release. Half the
layer uncalibrated (one EP rank's every expert) runs at DP=2+EP in every world.
"""

import pytest

from tests.uncalibrated_checks import many_dead_tests, world_tests
from vllm_fp4_moe_plugin.base.support import Design

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

rows, test_uncalibrated_expert = world_tests(Design.MODULAR_METHOD, ("single",))
many_dead_rows, test_half_the_layer_uncalibrated = many_dead_tests(Design.MODULAR_METHOD)
