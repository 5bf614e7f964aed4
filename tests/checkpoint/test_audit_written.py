# SPDX-License-Identifier: Apache-2.0
"""The audit on checkpoints that need torch or vLLM to write or to check against: the writer's
own checkpoints (exact numbers, lazy reads, shards), a float8 scale written through torch, and
config keys checked against the installed transformers and vLLM. The rest of the audit's tests
(tests/ut/test_audit.py) need neither and run in the unit tier."""

import json
import math

import pytest

from fp4_moe_lab.checkpoint.writer import write_checkpoint
from tests.real_quantizer_checks import MODELS
from tests.ut.test_audit import LAYER, NUM_EXPERTS, _RecordingSafeOpen, _uniform
from vllm_fp4_moe_plugin.tools.checkpoint import tensor_index
from vllm_fp4_moe_plugin.tools.checkpoint.audit import LAYOUTS, audit_checkpoint
from vllm_fp4_moe_plugin.tools.checkpoint.render import format_audit
from vllm_fp4_moe_plugin.tools.checkpoint.tensor_index import CheckpointAuditError

from .conftest import ARCHS, FORMATS
from .synthetic import write_scales_only


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_audit_reports_exactly_the_written_scales(written, arch, fmt):
    m = written[(arch, fmt)]
    report = audit_checkpoint(m["out_dir"])
    assert report["format"] == fmt
    assert [entry["layer"] for entry in report["layers"]] == [e["layer"] for e in m["layers"]]
    for got, want in zip(report["layers"], m["layers"]):
        assert got["num_experts"] == want["num_experts"]
        for key in ("w13_stored", "w2_stored", "w13_input_scale", "w2_input_scale"):
            assert got[key] == want[key], key
        assert got["w13_spread"] == got["w2_spread"] == m["input_scale_spread"] == 4.0
        s = want["w13_input_scale"]
        assert math.isclose(got["error_factor_max"], max(s) / s[0], rel_tol=1e-12)
        assert math.isclose(got["error_factor_min"], min(s) / s[0], rel_tol=1e-12)
        assert got["affected"] == {layout: True for layout in LAYOUTS}
        assert got["gate_up_mismatch"] == []
    assert report["affected_layers"] == len(m["layers"])
    assert report["summary"].startswith("AFFECTED")
    json.dumps(report)  # plain data, ready for --json


@pytest.mark.parametrize("fmt", FORMATS)
def test_uniform_scales_are_not_affected(tmp_path, fmt):
    m = write_checkpoint(tmp_path / "u", fmt=fmt, arch="qwen3_moe", input_scale_spread=1.0)
    report = audit_checkpoint(m["out_dir"])
    assert report["affected_layers"] == 0
    for entry in report["layers"]:
        assert entry["w13_spread"] == entry["w2_spread"] == 1.0
        assert entry["error_factor_max"] == entry["error_factor_min"] == 1.0
        assert not any(entry["affected"].values())
    assert report["summary"].startswith("not affected")
    assert "not affected" in format_audit(report)


def test_audit_reads_only_scale_tensors(written, monkeypatch):
    m = written[("deepseek_v3", "compressed-tensors")]
    recorder = _RecordingSafeOpen(tensor_index.safe_open)
    monkeypatch.setattr(tensor_index, "safe_open", recorder)  # headers and scale reads
    report = audit_checkpoint(m["out_dir"])
    assert recorder.read, "the audit went through safe_open"
    assert all(n.endswith((".input_global_scale", ".weight_global_scale"))
               for n in recorder.read), recorder.read[:5]
    assert len(recorder.read) == len(set(recorder.read)) == report["num_scale_tensors_read"]
    # Input and weight global scale of each expert's three projections; nothing else.
    assert len(recorder.read) == sum(6 * entry["num_experts"] for entry in m["layers"])


def test_sharded_written_checkpoint_audits_the_same(written, tmp_path):
    m = write_checkpoint(tmp_path / "s", fmt="modelopt", arch="deepseek_v3",
                         shard_size_bytes=3 * 1024 * 1024)
    a = audit_checkpoint(m["out_dir"])
    b = audit_checkpoint(written[("deepseek_v3", "modelopt")]["out_dir"])
    assert a["layers"] == b["layers"]


def test_format_audit_names_every_layer_and_layout(written):
    report = audit_checkpoint(written[("qwen3_moe", "modelopt")]["out_dir"])
    text = format_audit(report)
    for entry in report["layers"]:
        assert entry["layer"] in text
    for layout in LAYOUTS:
        assert layout in text
    assert "AFFECTED" in text and "4x" in text


def test_float8_input_scale_names_dtype_and_allowed_ones(tmp_path):
    """numpy cannot hold float8: the audit reads the dtype from the header and names it."""
    import torch
    from safetensors.torch import load_file
    from safetensors.torch import save_file as save_torch

    write_scales_only(tmp_path, "compressed-tensors", {LAYER: _uniform("compressed-tensors")})
    shard = tmp_path / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    name = f"{LAYER}.2.down_proj.input_global_scale"
    tensors[name] = torch.tensor([0.0625]).to(torch.float8_e4m3fn)
    save_torch(tensors, str(shard))
    with pytest.raises(CheckpointAuditError) as err:
        audit_checkpoint(tmp_path)
    msg = str(err.value)
    assert name in msg and "F8_E4M3" in msg and "float32" in msg and "numpy" not in msg


def test_transformers5_config_keys_are_named_with_the_key_to_add(tmp_path):
    """transformers 4.57 (vLLM 0.11.0's) reads num_experts/rope_theta, which a transformers-5
    config lacks: measured, it silently takes 128 experts and rope_theta 10000."""
    from transformers import AutoConfig

    write_scales_only(tmp_path, "compressed-tensors", {LAYER: _uniform("compressed-tensors")})
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["n_routed_experts"]
    cfg.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
               num_local_experts=NUM_EXPERTS,  # as transformers 5.17 wrote it
               rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend"}))
    # Reference check: what the installed transformers 4 really reads from this config.
    read = AutoConfig.from_pretrained(tmp_path)
    assert (read.num_experts, read.rope_theta) == (128, 10000.0)
    report = audit_checkpoint(tmp_path)
    misreads = report["transformers4_misreads"]
    assert len(misreads) == 3
    assert f'add "num_experts": {NUM_EXPERTS}' in misreads[0]
    assert 'add "rope_theta": 1000000.0' in misreads[1]
    assert '"PreTrainedTokenizerFast"' in misreads[2]
    assert all(m in format_audit(report) for m in misreads)


def test_llmcompressor_014_quantization_args_named_for_vllm_0_11(tmp_path):
    """llmcompressor 0.14 writes scale_dtype/zp_dtype, which compressed-tensors 0.11.0 (vLLM
    0.11.0) refuses at startup: the audit names them and the fix."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )

    qc = json.loads((MODELS / "qwen3moe-add-nvfp4-ct-all" / "config.json").read_text())[
        "quantization_config"]
    # Reference check: the installed vLLM 0.11.0 refuses it as written.
    with pytest.raises(Exception, match="scale_dtype"):
        CompressedTensorsConfig.from_config(json.loads(json.dumps(qc)))
    report = audit_checkpoint(MODELS / "qwen3moe-add-nvfp4-ct-all")
    (msg,) = report["compressed_tensors_011_refuses"]
    assert "scale_dtype, zp_dtype" in msg and "remove those keys" in msg
