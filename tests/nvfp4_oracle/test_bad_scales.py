# SPDX-License-Identifier: Apache-2.0
"""Bad checkpoint scales on the oracle design (CI: vLLM 0.34.0): the plugin refuses them with the
layer, the tensor and the expert named, in the same words as on 0.11.0
(tests/init_prepare_finalize); activation scales no calibration produced are loaded with the
calibrated max amax instead."""

import pytest

from fp4_moe_lab.simulation.layouts import LAYOUTS, spawn
from tests import uncalibrated_checks

pytestmark = pytest.mark.multiproc

FORMATS = ("modelopt", "compressed-tensors")


@pytest.fixture(scope="module")
def bad_scales():
    return spawn(LAYOUTS["single"], "tests.layer_jobs:bad_scales")[0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["input", "weight", "w2_input"])
@pytest.mark.parametrize("value", ["nan", "inf", "zero", "negative"])
def test_bad_checkpoint_scale_is_named(bad_scales, fmt, kind, value):
    uncalibrated_checks.check_bad_scale_row(bad_scales[f"{fmt}/{kind}/{value}"], kind, value)
