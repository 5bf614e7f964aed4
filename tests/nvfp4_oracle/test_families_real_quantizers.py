# SPDX-License-Identifier: Apache-2.0
"""The families' tiny models as the real quantizers wrote them (accuracy/quantize_families.py:
llmcompressor 0.14.0.1 with every expert calibrated on every token and with each on its routed
tokens, ModelOpt 0.47.0; accuracy/models/families/, what each run did in
accuracy/results/families-real-quantizers.json). ``audit`` finds each family's routed layers
under the names those tools write (shared experts, which ModelOpt's export quantizes too, are
not routed experts), judges Nemotron-H's non-gated experts, and refuses by name what it does not
model (ModelOpt's stacked Llama-4 export: one tensor and one scale for all experts); ``doctor``
follows the audit: at risk at DP+EP exactly where it finds a layer affected, fine with the
plugin on."""

import json
from pathlib import Path

import pytest

from fp4_moe_lab.checkpoint.families import FAMILIES, write_family_checkpoint
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.tools import doctor
from vllm_fp4_moe_plugin.tools.checkpoint.audit import CheckpointAuditError, audit_checkpoint

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "accuracy" / "models" / "families"
RUNS = json.loads((ROOT / "accuracy" / "results" / "families-real-quantizers.json")
                  .read_text())["runs"]
WRITTEN = sorted(name for name, run in RUNS.items() if run["ok"])
STACKED = {"llama4_text-modelopt"}  # ModelOpt 0.47 keeps Llama-4's experts stacked
L = doctor.deployed_layout


def _family(name: str) -> str:
    return next(f for f in FAMILIES if name.startswith(f + "-"))


@pytest.fixture(scope="module")
def writer_layers(tmp_path_factory):
    """The routed layers and gating of each family as the project's writer lays them out."""
    out = {}
    for f in FAMILIES:
        w = write_family_checkpoint(tmp_path_factory.mktemp(f), family=f)
        out[f] = (w["moe_layers"], w["gated"])
    return out


def test_every_family_went_through_both_quantizers_or_says_why():
    for f in FAMILIES:
        for q in ("llmcompressor", "llmcompressor-routed", "modelopt"):
            run = RUNS[f"{f}-{q}"]
            assert run["ok"] or run["error"], (f, q)
            assert run["ok"] is (MODELS / f"{f}-{q}" / "model.safetensors").is_file(), (f, q)


@pytest.mark.parametrize("name", [n for n in WRITTEN if n not in STACKED])
def test_audit_reads_what_the_real_quantizer_wrote(blackwell_env, writer_layers, name):
    family = _family(name)
    layers, gated = writer_layers[family]
    report = audit_checkpoint(str(MODELS / name), ep_size=2, design=Design.NVFP4_ORACLE)
    assert report["format"] == ("modelopt" if name.endswith("-modelopt")
                                else "compressed-tensors")
    assert [layer["layer"] for layer in report["layers"]] == layers
    assert all(layer["num_experts"] == 8 and layer["gated"] is gated
               for layer in report["layers"])
    spreads = [layer["w13_spread"] for layer in report["layers"]]
    if name.endswith("-routed"):  # each expert calibrated on its own tokens
        assert max(spreads) > 1.0, spreads
    else:  # one input scale per layer: every expert saw every token, or ModelOpt's export
        assert spreads == [1.0] * len(layers) and report["affected_layers"] == 0, spreads
    if family == "llama4_text":
        return  # its router weight decides (test_families.py)
    args = dict(capability="10.0", moe_backend="flashinfer_cutlass")
    r = doctor.run_doctor(str(MODELS / name), L(dp=2, ep=True), **args)
    assert r["verdict"] == (doctor.AT_RISK if report["affected_layers"] else doctor.FINE), \
        r["reasons"]
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(str(MODELS / name), L(dp=2, ep=True), **args)
    assert r["verdict"] == doctor.FINE, r["reasons"]


@pytest.mark.parametrize("name", sorted(STACKED))
def test_a_stacked_export_is_refused_by_name(name):
    with pytest.raises(CheckpointAuditError, match="stacked expert tensors"):
        audit_checkpoint(str(MODELS / name), ep_size=2, design=Design.NVFP4_ORACLE)
