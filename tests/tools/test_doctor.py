# SPDX-License-Identifier: Apache-2.0
"""doctor: every section, and the verdict in the situations an operator meets."""

import json
import subprocess
import sys

import pytest

from fp4_moe_lab.checkpoint.writer import write_checkpoint
from vllm_fp4_moe_plugin.tools import doctor

TP4_EP = doctor.deployed_layout(tp=4, ep=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, spread in (("spread", 4.0), ("uniform", 1.0)):
        path = tmp_path_factory.mktemp(name)
        write_checkpoint(path, fmt="modelopt", arch="qwen3_moe", input_scale_spread=spread)
        out[name] = path
    return out


def test_sections_on_a_machine_without_gpu(blackwell_env):
    r = doctor.run_doctor()
    assert r["versions"]["vllm"] == "0.11.0" and r["versions"]["vllm-fp4-moe-plugin"]
    assert r["gpu"]["available"] is False and "no CUDA" in r["gpu"]["reason"]
    assert r["entry_point"]["discoverable"]
    assert r["probes"]["would_install"] and r["probes"]["findings"]["init_prepare_finalize"]
    assert r["layout"]["kernel"] is None and "--capability" in r["layout"]["why"]
    assert r["verdict"] == doctor.CANNOT_TELL
    text = doctor.format_doctor(r)
    for section in ("versions:", "gpu: none", "environment:", "entry point", "probes:",
                    "verdict: CANNOT TELL"):
        assert section in text


def test_spread_checkpoint_is_at_risk_without_the_plugin(blackwell_env, checkpoints):
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability="10.0")
    assert r["layout"]["name"] == "tp_ep" and r["layout"]["kernel"] == "flashinfer_cutlass"
    assert all(row["stock_consistent"] is False for row in r["layers"])
    assert r["plugin"]["would_be_active"] is False
    assert r["verdict"] == doctor.AT_RISK


def test_spread_checkpoint_is_fine_with_the_plugin(blackwell_env, checkpoints):
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability="10.0")
    assert r["plugin"]["would_be_active"]
    assert all(row["plugin_consistent"] for row in r["layers"])
    assert r["verdict"] == doctor.FINE


def test_uniform_checkpoint_is_fine_without_the_plugin(blackwell_env, checkpoints):
    r = doctor.run_doctor(str(checkpoints["uniform"]), TP4_EP, capability="10.0")
    assert all(row["stock_consistent"] for row in r["layers"])
    assert r["verdict"] == doctor.FINE


def test_vllm_plugins_filter_is_reported(blackwell_env, checkpoints):
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    blackwell_env.setenv("VLLM_PLUGINS", "someone_else")
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability="10.0")
    assert r["environment"]["vllm_plugins_filters_us_out"]
    assert not r["plugin"]["would_load"] and r["verdict"] == doctor.AT_RISK
    assert "VLLM_PLUGINS does not list 'fp4_moe'" in doctor.format_doctor(r)


def test_vllm_with_an_unknown_moe_design(blackwell_env, checkpoints):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    blackwell_env.setattr(FusedMoE, "maybe_init_modular_kernel", lambda self: None, raising=False)
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability="10.0")
    assert (not r["probes"]["would_install"]
            and "none of the designs this plugin knows" in r["probes"]["reason"])
    # Neither design the plugin models: doctor will not guess whether stock is consistent.
    assert not r["plugin"]["would_be_active"] and r["verdict"] == doctor.CANNOT_TELL
    assert all("not modelled" in row["note"] for row in r["layers"])


def test_bad_switch_value_is_at_risk(blackwell_env):
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "yes")
    r = doctor.run_doctor(probe_vllm=False)
    assert "VLLM_FP4_MOE_PLUGIN='yes'" in r["environment"]["switch_error"]
    assert r["verdict"] == doctor.AT_RISK


# 0.11.0 with VLLM_USE_FLASHINFER_MOE_FP4=1: FlashInfer on exactly 10.0; elsewhere vLLM's own
# kernel, built for sm_100a only (support.nvfp4_moe_kernel)
@pytest.mark.parametrize("capability,kernel", [("10.0", "flashinfer_cutlass"),
                                               ("10.3", "fails_to_start"),
                                               ("12.0", "fails_to_start"),
                                               ("12.1", "fails_to_start"), ("9.0", "marlin"),
                                               ("7.5", None)])
def test_kernel_path(blackwell_env, capability, kernel):
    assert doctor.kernel_path(capability, "modelopt")[0] == kernel


@pytest.mark.parametrize("capability", ["10.3", "12.0", "12.1"])
def test_a_gpu_without_a_kernel_is_at_risk_with_the_reason(blackwell_env, checkpoints, capability):
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability=capability)
    assert r["verdict"] == doctor.AT_RISK
    assert any("cannot serve it here" in line and "no image for this GPU" in line
               for line in r["reasons"]), r["reasons"]


def test_cli_json_and_exit_code(checkpoints):
    env = {"PATH": "/usr/bin:/bin", "VLLM_USE_FLASHINFER_MOE_FP4": "1"}
    r = subprocess.run([sys.executable, "-m", "vllm_fp4_moe_plugin.tools.cli", "doctor", "--json",
                        "--checkpoint", str(checkpoints["spread"]), "--tp", "4", "--ep",
                        "--capability", "10.0"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == doctor.AT_RISK, r.stderr[-2000:]
    report = json.loads(r.stdout)
    assert report["verdict_text"] == "at risk" and report["layers"]


@pytest.mark.parametrize("value, loads", [("fp4_moe", True), ("other,fp4_moe", True),
                                          ("other, fp4_moe", False), (" fp4_moe", False),
                                          ("", False), ("fp4_moe,", True)])
def test_vllm_plugins_is_parsed_as_vllm_parses_it(monkeypatch, value, loads):
    """vLLM 0.11.0 envs.py: VLLM_PLUGINS.split(',') with no strip."""
    import vllm.envs

    allowed = doctor.vllm_plugins_allowed(value)
    assert (doctor.ENTRY_POINT in allowed) is loads
    monkeypatch.setenv("VLLM_PLUGINS", value)
    assert vllm.envs.VLLM_PLUGINS == allowed  # the very list vLLM computes


def test_vllm_plugins_with_a_space_is_at_risk_with_its_reason(blackwell_env, checkpoints):
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    blackwell_env.setenv("VLLM_PLUGINS", "other, fp4_moe")
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability="10.0")
    assert not r["plugin"]["would_load"] and r["verdict"] == doctor.AT_RISK
    text = doctor.format_doctor(r)
    assert "because: VLLM_PLUGINS='other, fp4_moe' does not name 'fp4_moe'" in text
    assert "' fp4_moe' does not match" in text


def test_bad_check_mode_is_at_risk_with_its_reason(blackwell_env):
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "bogus")
    r = doctor.run_doctor(probe_vllm=False)
    assert r["verdict"] == doctor.AT_RISK
    assert "because: vLLM would refuse to start: VLLM_FP4_MOE_PLUGIN_CHECK='bogus'" in \
        doctor.format_doctor(r)


def test_every_at_risk_layer_is_explained_in_text(blackwell_env, checkpoints):
    r = doctor.run_doctor(str(checkpoints["spread"]), TP4_EP, capability="10.0")
    assert r["verdict"] == doctor.AT_RISK
    text = doctor.format_doctor(r)
    for row in r["layers"]:
        assert f"because: {row['layer']}: stock vLLM (plugin not active) computes it " \
               "inconsistently in layout tp_ep" in text


def test_transformers5_config_is_at_risk_under_transformers4(blackwell_env, tmp_path):
    """vLLM 0.11.0's transformers 4 reads num_experts; a config written by transformers 5 has
    num_local_experts only: doctor names the key to add and says at risk."""
    write_checkpoint(tmp_path, fmt="modelopt", arch="qwen3_moe", input_scale_spread=1.0)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["num_local_experts"] = cfg.pop("num_experts")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = doctor.run_doctor(str(tmp_path), TP4_EP, capability="10.0")
    assert r["versions"]["transformers"].startswith("4.")
    assert all(row["stock_consistent"] for row in r["layers"])  # only the config is at fault
    assert r["verdict"] == doctor.AT_RISK
    assert any('add "num_experts"' in reason for reason in r["reasons"])


def test_says_whether_ray_workers_receive_the_switch(blackwell_env):
    """vLLM 0.11.0 copies to Ray workers only the variables its registry lists: stock no,
    with the plugin (which lists its own) yes; where the fleet check runs, and the scale
    agreement's wait, are shown."""
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor()
    ray = r["deployment"]["ray"]
    assert ray == {"stock_copies_switch": False, "copies_switch_with_plugin": True,
                   "excluded_by": None}
    assert r["deployment"]["timeout_s"] == 600
    text = doctor.format_doctor(r)
    assert "Ray workers receive VLLM_FP4_MOE_PLUGIN from the driver: stock vLLM no, with the " \
           "plugin yes" in text
    assert "waits up to 600 s (VLLM_FP4_MOE_PLUGIN_TIMEOUT_S)" in text
    assert r["deployment"]["fleet_rendezvous"] is True
    assert "fleet check: every rank at vLLM's distributed initialisation" in text


def test_a_ray_exclusion_of_the_switch_is_at_risk(blackwell_env, monkeypatch):
    from vllm.ray import ray_env

    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    monkeypatch.setattr(ray_env, "RAY_NON_CARRY_OVER_ENV_VARS", {"VLLM_FP4_MOE_PLUGIN"})
    r = doctor.run_doctor()
    assert r["deployment"]["ray"]["copies_switch_with_plugin"] is False
    assert r["verdict"] == doctor.AT_RISK
    assert any("workers would start without VLLM_FP4_MOE_PLUGIN" in why and "ray start" in why
               for why in r["reasons"]), r["reasons"]


@pytest.mark.parametrize("value", ["abc", "0", "-1"])
def test_a_bad_timeout_is_an_error(blackwell_env, value):
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN_TIMEOUT_S", value)
    r = doctor.run_doctor()
    assert r["verdict"] == doctor.AT_RISK
    assert any("VLLM_FP4_MOE_PLUGIN_TIMEOUT_S" in why and "refuse to start" in why
               for why in r["reasons"]), r["reasons"]


@pytest.mark.parametrize("strict", [False, True])
def test_enabled_but_inactive_is_named(blackwell_env, monkeypatch, strict):
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    monkeypatch.setattr(FusedMoE, "maybe_init_modular_kernel", lambda self: None, raising=False)
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    if strict:
        blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "strict")
    r = doctor.run_doctor()
    why = [w for w in r["reasons"] if "would stay inactive" in w]
    assert why and "none of the designs this plugin knows" in why[0], r["reasons"]
    assert ("would refuse to start" if strict else "would serve stock vLLM") in why[0]


@pytest.mark.parametrize("case", ["zero", "missing"])
def test_uncalibrated_experts_are_named_also_when_fine(blackwell_env, tmp_path, case):
    """One expert's gate input_scale is 0 (or absent, vllm#45212) in a ModelOpt checkpoint,
    TP=2+EP, plugin on: the verdict is fine (the plugin repairs it), and doctor names the
    expert and what the plugin does; strict mode would refuse to load it."""
    from tests.checkpoint.synthetic import SCALE, write_scales_only

    layer = "model.layers.3.mlp.experts"
    w13, w2 = [0.02] * 8, [0.05] * 8
    name = f"{layer}.5.gate_proj.{SCALE['modelopt']}"
    if case == "zero":
        w13[5] = 0.0
    write_scales_only(tmp_path, "modelopt", {layer: (w13, w2)},
                      drop=(name,) if case == "missing" else ())
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    tp2_ep = doctor.deployed_layout(tp=2, ep=True)
    r = doctor.run_doctor(str(tmp_path), tp2_ep, capability="10.0")
    assert r["verdict"] == doctor.FINE, r["reasons"]
    (why,) = [w for w in r["reasons"] if "uncalibrated" in w]
    assert f"{layer}: uncalibrated activation scale(s), w13 expert(s) [5]" in why
    assert "the plugin loads the calibrated experts' max amax" in why
    assert ("missing from the checkpoint: [5]" in why) is (case == "missing")
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "strict")
    r = doctor.run_doctor(str(tmp_path), tp2_ep, capability="10.0")
    assert r["verdict"] == doctor.AT_RISK
    assert any("refuses to load it" in w for w in r["reasons"]), r["reasons"]


@pytest.mark.parametrize("plugin", ["0", "1"])
def test_split_gate_up_weight_scales_at_risk_on_stock_fine_with_the_plugin(blackwell_env,
                                                                           tmp_path, plugin):
    """A checkpoint whose experts carry gate and up weight global scales of their own (the up
    half 4x): stock vLLM reads the up half with the gate's scale in every layout (at risk, the
    layer and ratio named; it said FINE before); the plugin carries the factor (fine)."""
    from safetensors.torch import load_file, save_file

    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", plugin)
    write_checkpoint(tmp_path, fmt="modelopt", arch="qwen3_moe", input_scale_spread=1.0)
    shard = next(tmp_path.glob("*.safetensors"))
    tensors = load_file(str(shard))
    name = next(n for n in sorted(tensors) if n.endswith("experts.1.up_proj.weight_scale_2"))
    tensors[name] = tensors[name] * 4
    save_file(tensors, str(shard))
    r = doctor.run_doctor(str(tmp_path), doctor.deployed_layout(tp=2, ep=True), capability="10.0")
    why = [line for line in r["reasons"] if "gate and up weight global scales differ" in line]
    if plugin == "1":
        assert r["verdict"] == doctor.FINE and not why
        return
    assert r["verdict"] == doctor.AT_RISK
    assert why and "expert(s) [1]" in why[0] and "4x" in why[0]


def test_non_gated_experts_cannot_be_judged_on_the_gated_only_design(blackwell_env, tmp_path):
    """vLLM 0.11.0's MoE layer is gated only: a Nemotron-H checkpoint (up_proj, down_proj) does
    not load there, so doctor says it cannot tell (exit 2) and why, with the plugin on or off."""
    from tests.checkpoint.synthetic import write_scales_only

    write_scales_only(tmp_path, "modelopt",
                      {"backbone.layers.1.mixer.experts": ([0.25] * 8, [16.0] * 8)},
                      projs=("up_proj", "down_proj"),
                      config={"architectures": ["NemotronHForCausalLM"],
                              "model_type": "nemotron_h", "n_routed_experts": 8})
    for plugin in ("0", "1"):
        blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", plugin)
        r = doctor.run_doctor(str(tmp_path), doctor.deployed_layout(tp=2, ep=True),
                              capability="10.0")
        assert r["verdict"] == doctor.CANNOT_TELL, r["reasons"]
        assert any("non-gated experts" in w and "gated only" in w for w in r["reasons"])
