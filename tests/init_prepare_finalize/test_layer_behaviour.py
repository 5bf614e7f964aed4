# SPDX-License-Identifier: Apache-2.0
"""What the plugin does to real layers besides the happy path: bad scales, guards, other
backends left alone, the TRT-LLM scale, and the DP scale agreement across ranks."""

import pytest
import torch

from fp4_moe_lab.simulation.judge import rel_err
from fp4_moe_lab.simulation.layouts import LAYOUTS, Layout, Scenario, spawn
from fp4_moe_lab.simulation.matrix import references
from tests import uncalibrated_checks
from tests.pass_marks import PLUGIN_BOUND

pytestmark = pytest.mark.multiproc

JOBS = "tests.layer_jobs"
FORMATS = ("modelopt", "compressed-tensors")


@pytest.fixture(scope="module")
def bad_scales():
    return spawn(LAYOUTS["single"], f"{JOBS}:bad_scales")[0]


@pytest.fixture(scope="module")
def other_backends():
    return spawn(LAYOUTS["single"], f"{JOBS}:other_backends")[0]


@pytest.fixture(scope="module")
def placement():
    return spawn(Layout("tp_ep_round_robin", tp=2, ep=True, placement="round_robin"),
                 f"{JOBS}:placement_guards")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ["input", "weight", "w2_input"])
@pytest.mark.parametrize("value", ["nan", "inf", "zero", "negative"])
def test_bad_checkpoint_scale_is_named(bad_scales, fmt, kind, value):
    uncalibrated_checks.check_bad_scale_row(bad_scales[f"{fmt}/{kind}/{value}"], kind, value)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("path", ["vllm_cutlass", "marlin"])
def test_other_backends_are_left_alone(other_backends, path, fmt):
    res = other_backends[f"{path}/{fmt}"]
    stock, plugin = res["stock"], res["plugin"]
    if path == "vllm_cutlass":
        assert not plugin["allow_flashinfer"] and not plugin["use_marlin"]
    else:
        assert plugin["use_marlin"]
    assert plugin["prepare_finalize"] == stock["prepare_finalize"]
    assert stock["state"].keys() == plugin["state"].keys()
    for k in stock["state"]:
        assert torch.equal(stock["state"][k], plugin["state"][k]), k
    if stock["config"] is None:
        assert plugin["config"] is None
    else:
        for k in stock["config"]:
            assert torch.equal(stock["config"][k], plugin["config"][k]), k


def test_trtllm_gemm1_scale(other_backends):
    """fp4_quantize reads element 0 of w13_input_scale_quant; alpha_e must match *that* scale."""
    res = other_backends["trtllm/modelopt"]
    for mode in ("stock", "plugin"):
        assert "TENSORRT_LLM" in res[mode]["backend"]
    # Reference check: alpha_e * (scale actually used) == ws2_e, and g1_scale_c = a2_e * alpha_e.
    def consistency(r):
        used = r["w13_input_scale_quant"][0]
        return r["g1_alphas"] * used / r["w13_weight_scale_2"]
    stock, plugin = res["stock"], res["plugin"]
    assert (consistency(stock) - 1).abs().max() > 0.5  # the bug, on the stock layer
    torch.testing.assert_close(consistency(plugin), torch.ones_like(plugin["g1_alphas"]))
    assert torch.all(plugin["w13_input_scale_quant"] == plugin["w13_input_scale_quant"].min())
    assert float(plugin["w13_input_scale_quant"][0]) == float(stock["w13_input_scale_quant"].min())
    torch.testing.assert_close(plugin["g1_scale_c"],
                               plugin["w2_input_scale_quant"] * plugin["g1_alphas"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_robin_placement_refused(placement, fmt):
    for rank in placement:
        assert rank[f"round_robin/{fmt}/stock"] is None  # stock builds and mis-routes
        assert rank[f"round_robin/{fmt}/stock/map"] != sorted(rank[f"round_robin/{fmt}/stock/map"])
        msg = rank[f"round_robin/{fmt}/plugin"]
        assert msg.startswith("UnsupportedLayoutError") and "--expert-placement-strategy" in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_uneven_experts_refused(placement, fmt):
    for rank in placement:
        assert rank[f"uneven/{fmt}/stock"] is None
        msg = rank[f"uneven/{fmt}/plugin"]
        assert msg.startswith("UnsupportedLayoutError") and "7 experts" in msg


@pytest.mark.parametrize("fmt", FORMATS)
def test_eplb_refused(placement, fmt):
    """vLLM 0.11.0 itself refuses EPLB for NVFP4 in FusedMoE.__init__, before our guard runs;
    the plugin must not weaken that."""
    for rank in placement:
        for mode in ("stock", "plugin"):
            msg = rank[f"eplb/{fmt}/{mode}"]
            assert msg is not None and "EPLB" in msg, (mode, msg)


def test_uniform_scales_control():
    """With equal input scales stock is already right: the error it shows elsewhere is the bug,
    not an artefact of the emulator or the references."""
    scenario = Scenario(input_scale_spread=1.0)
    r = spawn(LAYOUTS["single"], f"{JOBS}:uniform_scales_control")[0]
    ideal, _ = references(scenario, 0, "per_expert")
    for fmt in FORMATS:
        stock = rel_err(r.outputs[f"{fmt}/stock"], ideal)
        plugin = rel_err(r.outputs[f"{fmt}/plugin"], ideal)
        assert stock <= PLUGIN_BOUND and plugin <= PLUGIN_BOUND
        assert stock == pytest.approx(plugin, abs=1e-6)


@pytest.mark.parametrize("layout", ["dp_ep_allgather", "dp"])
def test_dp_scale_is_agreed_across_ranks(layout):
    """Each DP rank holds different experts, yet all quantize with the EP-group-wide min."""
    scenario = Scenario()
    gs = scenario.experts().w13_input_gs
    ranks = spawn(LAYOUTS[layout], "fp4_moe_lab.simulation.layouts:"
                  "stock_and_plugin_outputs", scenario, ("compressed-tensors",), ("plugin",))
    used = [r.info["compressed-tensors/plugin"]["a1_gscale"] for r in ranks]
    assert all(u == [float(gs.min())] for u in used), used


@pytest.fixture(scope="module")
def check_modes():
    return spawn(LAYOUTS["single"], f"{JOBS}:check_modes")[0]


def test_check_passes_a_consistent_layer(check_modes):
    for mode in ("warn", "strict"):
        r = check_modes[f"consistent/{mode}"]
        assert r["error"] is None and r["check"][0] is True
        summary = [m for lvl, m in r["logs"] if "check:" in m]
        assert summary and "consistent" in summary[0] and all(lvl == "INFO" for lvl, _ in
                                                              r["logs"] if "check:" in _)


def test_check_modes_on_an_inconsistent_layer(check_modes):
    off, warn, strict = (check_modes[f"inconsistent/{m}"] for m in ("off", "warn", "strict"))
    assert off["error"] is None and off["check"] is None and not off["logs"]
    assert warn["error"] is None and warn["check"][0] is False
    warnings = [m for lvl, m in warn["logs"] if lvl == "WARNING"]
    assert len(warnings) == 1 and "inconsistent" in warnings[0] and "a1_gscale[0]" in warnings[0]
    assert strict["error"].startswith("InconsistentMoELayerError")
    assert "model.layers." in strict["error"] and "off by" in strict["error"]


def test_installed_but_off_warns_once_on_a_spread_checkpoint():
    r = spawn(LAYOUTS["single"], f"{JOBS}:off_warning")[0]
    warned = r["unset/4.0"]
    assert len(warned) == 1, warned
    assert "installed but off" in warned[0] and "VLLM_FP4_MOE_PLUGIN=1" in warned[0]
    assert "spread 4x" in warned[0]
    assert r["unset/1.0"] == []   # uniform scales: stock is right, no warning
    assert r["0/4.0"] == [] and r["0/1.0"] == []  # explicit opt-out stays silent
