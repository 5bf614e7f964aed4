# SPDX-License-Identifier: Apache-2.0
"""Each NVFP4 MoE family's tiny checkpoint, built from transformers' own model class (the 0.34.0
world has transformers 5) and quantized by the project's writer
(lab/fp4_moe_lab/checkpoint/families.py): ``audit`` finds every routed layer under the family's
module path, judges Nemotron-H's non-gated experts as one GEMM1 projection, and gives the
oracle design's verdict (the EP slices' GEMM1 maxima differ: DP+EP affected, nothing else);
``doctor`` follows it per layout and kernel, and is fine with the plugin on."""

import pytest

from fp4_moe_lab.checkpoint.families import FAMILIES, write_family_checkpoint
from vllm_fp4_moe_plugin import doctor
from vllm_fp4_moe_plugin.checkpoint.audit import audit_checkpoint
from vllm_fp4_moe_plugin.support import Design

L = doctor.deployed_layout


@pytest.fixture(scope="module")
def family_checkpoints(tmp_path_factory):
    return {f: write_family_checkpoint(tmp_path_factory.mktemp(f), family=f)
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


@pytest.mark.parametrize("plugin", ["0", "1"])
def test_llama4_on_a_kernel_that_weights_twice_is_at_risk(blackwell_env, family_checkpoints,
                                                          plugin):
    """Llama-4's router weight on the input is applied again on the output by FlashInfer
    CUTLASS (matrix --router-weight-on-input): doctor names it with the plugin on or off (it is
    not a scale the plugin repairs); on TRT-LLM, which takes the weight itself, it does not."""
    path = family_checkpoints["llama4_text"]["out_dir"]
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", plugin)
    r = doctor.run_doctor(path, L(tp=2, ep=True), capability="10.0",
                          moe_backend="flashinfer_cutlass")
    assert r["verdict"] == doctor.AT_RISK
    assert any("weighted twice" in w for w in r["reasons"]), r["reasons"]
    r = doctor.run_doctor(path, L(tp=2, ep=True), capability="10.0")
    assert r["layout"]["kernel"] == "flashinfer_trtllm"
    assert not any("weighted twice" in w for w in r["reasons"]), r["reasons"]
