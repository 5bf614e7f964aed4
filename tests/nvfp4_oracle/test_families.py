# SPDX-License-Identifier: Apache-2.0
"""Each NVFP4 MoE family's tiny checkpoint, built from transformers' own model class (the 0.34.0
world has transformers 5) and quantized by the project's writer
(lab/fp4_moe_lab/checkpoint/families.py), in both formats: ``audit`` finds every routed layer
under the family's module path, judges Nemotron-H's non-gated experts as one GEMM1 projection,
and gives the oracle design's verdict (compressed-tensors: the EP slices' GEMM1 maxima differ,
DP+EP affected, nothing else; ModelOpt: nothing affected); ``doctor`` follows it per layout and
kernel, and is fine with the plugin on."""

import pytest

from fp4_moe_lab.checkpoint.families import FAMILIES, write_family_checkpoint
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.tools import doctor
from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint

L = doctor.deployed_layout


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    return {f: write_family_checkpoint(tmp_path_factory.mktemp(f), family=f)
            for f in FAMILIES}


@pytest.fixture(scope="module")
def modelopt_checkpoints(tmp_path_factory):
    return {f: write_family_checkpoint(tmp_path_factory.mktemp(f"{f}-modelopt"), family=f,
                                       fmt="modelopt")
            for f in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_audit_reads_each_familys_checkpoint(family_checkpoints, family):
    written = family_checkpoints[family]
    report = audit_checkpoint(written["out_dir"], ep_size=2, design=Design.NVFP4_ORACLE)
    assert [layer["layer"] for layer in report["layers"]] == written["moe_layers"]
    assert all(layer["gated"] is written["gated"] for layer in report["layers"])
    assert all(layer["num_experts"] == 8 for layer in report["layers"])
    assert report["affected_layers"] == len(written["moe_layers"])
    hit = {lay for layer in report["layers"] for lay, bad in layer["affected"].items() if bad}
    assert hit == {"dp_ep_allgather", "dp_ep_all2allv", "dp_ep_one_sided"}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama4_text"])
def test_doctor_judges_each_family_at_dp_ep(blackwell_env, family_checkpoints, family):
    path = family_checkpoints[family]["out_dir"]
    args = dict(capability="10.0", moe_backend="flashinfer_cutlass")
    assert doctor.run_doctor(path, L(dp=2, ep=True), **args)["verdict"] == doctor.AT_RISK
    assert doctor.run_doctor(path, L(tp=2, ep=True), **args)["verdict"] == doctor.FINE
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(path, L(dp=2, ep=True), **args)
    assert r["verdict"] == doctor.FINE, r["reasons"]


@pytest.mark.parametrize("kernel", ["flashinfer_cutlass", "cutlass"])  # --moe-backend
def test_llama4_on_a_kernel_that_weights_twice(blackwell_env, family_checkpoints, kernel):
    """Llama-4's router weight on the input is applied again by FlashInfer CUTLASS and vLLM's
    CUTLASS (matrix --router-weight-on-input): doctor says AT RISK with the plugin off and
    names the switch; with it on, the plugin applies the weight once: FINE. On TRT-LLM, which
    takes the weight itself, nothing to say."""
    path = family_checkpoints["llama4_text"]["out_dir"]
    r = doctor.run_doctor(path, L(tp=2, ep=True), capability="10.0", moe_backend=kernel)
    assert r["verdict"] == doctor.AT_RISK
    assert any("a second time" in w and "VLLM_FP4_MOE_PLUGIN=1" in w for w in r["reasons"]), \
        r["reasons"]
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(path, L(tp=2, ep=True), capability="10.0", moe_backend=kernel)
    assert r["verdict"] == doctor.FINE, r["reasons"]
    r = doctor.run_doctor(path, L(tp=2, ep=True), capability="10.0")
    assert r["layout"]["kernel"] == "flashinfer_trtllm"
    assert not any("a second time" in w for w in r["reasons"]), r["reasons"]


def test_llama4_on_trtllms_modular_experts(blackwell_env, family_checkpoints):
    """Under DP+EP vLLM runs TRT-LLM's modular experts, which weight the output whatever the
    flag (matrix --router-weight-on-input --backend flashinfer_trtllm): AT RISK with the plugin
    off, FINE with it on; under TP+EP its self-routing kernel (the test above): nothing."""
    path = family_checkpoints["llama4_text"]["out_dir"]
    args = dict(capability="10.0", moe_backend="flashinfer_trtllm")
    r = doctor.run_doctor(path, L(dp=2, ep=True), **args)
    assert r["layout"]["kernel"] == "flashinfer_trtllm"
    assert any("a second time" in w for w in r["reasons"]), r["reasons"]
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = doctor.run_doctor(path, L(dp=2, ep=True), **args)
    assert not any("a second time" in w for w in r["reasons"]), r["reasons"]


@pytest.mark.parametrize("family", FAMILIES)
def test_modelopt_checkpoints_of_each_family_are_read_and_not_at_risk(
        blackwell_env, family_checkpoints, modelopt_checkpoints, family):
    """The same families in ModelOpt's format (hf_quant_config.json, every other module named
    in exclude_modules): audit finds the same routed layers, gated or not; the oracle design
    takes ModelOpt's GEMM1 scale from the whole layer, so no layout is affected, and doctor
    says so at DP+EP with the plugin off (Llama-4 aside: its router weight, any format)."""
    written = modelopt_checkpoints[family]
    report = audit_checkpoint(written["out_dir"], ep_size=2, design=Design.NVFP4_ORACLE)
    assert report["format"] == "modelopt"
    assert [layer["layer"] for layer in report["layers"]] == \
        family_checkpoints[family]["moe_layers"] == written["moe_layers"]
    assert all(layer["gated"] is written["gated"] for layer in report["layers"])
    assert report["affected_layers"] == 0
    if family == "llama4_text":
        return
    r = doctor.run_doctor(written["out_dir"], L(dp=2, ep=True), capability="10.0",
                          moe_backend="flashinfer_cutlass")
    assert r["verdict"] == doctor.FINE, r["reasons"]
