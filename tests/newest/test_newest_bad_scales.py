"""Bad checkpoint scales on the oracle design (CI: vLLM 0.34.0): the plugin refuses them with the
layer, the tensor and the expert named, in the same words as on 0.11.0 (tests/layers)."""

import pytest

from vllm_fp4_moe_plugin.simulation.layouts import LAYOUTS, spawn

pytestmark = [pytest.mark.cpu, pytest.mark.multiproc]

FORMATS = ("modelopt", "compressed-tensors")


@pytest.fixture(scope="module")
def bad_scales():
    return spawn(LAYOUTS["single"], "tests.layers.jobs:bad_scales")[0]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["input", "weight", "w2_input"])
@pytest.mark.parametrize("value", ["nan", "inf", "zero", "negative"])
def test_bad_checkpoint_scale_is_named(bad_scales, fmt, kind, value):
    row = bad_scales[f"{fmt}/{kind}/{value}"]
    msg = row["plugin"]
    assert row["stock"] is None  # stock 0.34.0 loads and processes it silently
    kind_word = {"nan": "NaN", "inf": "inf", "zero": "zero", "negative": "negative"}[value]
    assert msg is not None and msg.startswith("InvalidScaleError"), msg
    assert row["layer"] in msg and repr(row["param"]) in msg
    assert kind_word in msg and "expert index 3" in msg
