# SPDX-License-Identifier: Apache-2.0
"""The tiny checkpoint writer: deterministic bytes, exact scale spreads, valid configs, sharding."""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fp4_moe_lab.checkpoint.writer import write_checkpoint

from .conftest import ARCHS, FORMATS

MAX_CHECKPOINT_BYTES = 10 * 1024 * 1024
SPREADS = (1.0, 2.5, 3.0, 4.0)
SMALL = {"num_experts": 8, "num_hidden_layers": 1}  # qwen3_moe overrides for fast writes
SCALE = {"modelopt": "input_scale", "compressed-tensors": "input_global_scale"}
WEIGHT_SCALE = {"modelopt": "weight_scale_2", "compressed-tensors": "weight_global_scale"}


def _files(out_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(Path(out_dir).iterdir())}


def _tensors(manifest) -> dict[str, torch.Tensor]:
    out = {}
    for path in manifest["paths"]:
        if path.endswith(".safetensors"):
            with safe_open(path, framework="pt") as f:
                out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_same_arguments_give_identical_bytes(written, tmp_path, arch, fmt):
    first = written[(arch, fmt)]
    again = write_checkpoint(tmp_path / "again", fmt=fmt, arch=arch)
    assert _files(first["out_dir"]) == _files(again["out_dir"])
    assert again["layers"] == first["layers"]


def test_another_seed_gives_other_weights_and_scales(written, tmp_path):
    first = written[("qwen3_moe", "modelopt")]
    other = write_checkpoint(tmp_path / "seed1", fmt="modelopt", arch="qwen3_moe", seed=1)
    a, b = _tensors(first), _tensors(other)
    assert a.keys() == b.keys()
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert not torch.equal(a[name], b[name])
    assert other["layers"][0]["w13_stored"] != first["layers"][0]["w13_stored"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_default_checkpoints_are_small_and_spread_exactly(written, arch, fmt):
    m = written[(arch, fmt)]
    assert sum(m["files_bytes"].values()) <= MAX_CHECKPOINT_BYTES
    assert m["layers"], "every arch has MoE layers"
    for layer in m["layers"]:
        for gemm in ("w13", "w2"):
            stored = layer[f"{gemm}_stored"]
            assert max(stored) / min(stored) == 4.0
            assert len(set(stored)) == layer["num_experts"], "every expert has its own scale"
        assert not set(layer["w13_stored"]) & set(layer["w2_stored"])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_files_hold_the_manifest_scales_and_shared_gate_up(written, arch, fmt):
    m = written[(arch, fmt)]
    tensors = _tensors(m)
    for layer in m["layers"]:
        p = layer["layer"]
        for e in range(layer["num_experts"]):
            gate = tensors[f"{p}.{e}.gate_proj.{SCALE[fmt]}"]
            up = tensors[f"{p}.{e}.up_proj.{SCALE[fmt]}"]
            down = tensors[f"{p}.{e}.down_proj.{SCALE[fmt]}"]
            assert gate.dtype == torch.float32
            assert gate.item() == up.item() == layer["w13_stored"][e]
            assert down.item() == layer["w2_stored"][e]
            assert torch.equal(tensors[f"{p}.{e}.gate_proj.{WEIGHT_SCALE[fmt]}"],
                               tensors[f"{p}.{e}.up_proj.{WEIGHT_SCALE[fmt]}"])


@pytest.mark.parametrize("arch", ARCHS)
def test_both_formats_hold_the_same_model(written, arch):
    """Power-of-two spread: CT's global scales are the reciprocals of ModelOpt's scales."""
    mo, ct = written[(arch, "modelopt")], written[(arch, "compressed-tensors")]
    for a, b in zip(mo["layers"], ct["layers"]):
        for gemm in ("w13", "w2"):
            want = (1.0 / torch.tensor(a[f"{gemm}_stored"])).tolist()  # fp32 reciprocal
            assert b[f"{gemm}_stored"] == want
    ta, tb = _tensors(mo), _tensors(ct)
    name = f"{mo['layers'][0]['layer']}.3.down_proj"
    assert torch.equal(ta[f"{name}.weight_scale"].view(torch.uint8),
                       tb[f"{name}.weight_scale"].view(torch.uint8))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("spread", SPREADS)
def test_spread_is_exact_in_the_stored_quantity(tmp_path, fmt, spread):
    m = write_checkpoint(tmp_path / "c", fmt=fmt, arch="qwen3_moe", input_scale_spread=spread,
                         **SMALL)
    (layer,) = m["layers"]
    for gemm in ("w13", "w2"):
        stored = layer[f"{gemm}_stored"]
        assert max(stored) / min(stored) == spread
        assert len(set(stored)) == (1 if spread == 1.0 else layer["num_experts"])


@pytest.mark.parametrize("arch", ARCHS)
def test_modelopt_config_is_the_nested_hf_quant_config(written, arch):
    m = written[(arch, "modelopt")]
    root = Path(m["out_dir"])
    assert "quantization_config" not in json.loads((root / "config.json").read_text())
    hq = json.loads((root / "hf_quant_config.json").read_text())
    assert hq["producer"] == {"name": "modelopt", "version": "0.23.0"}
    q = hq["quantization"]
    assert (q["quant_algo"], q["group_size"], q["kv_cache_quant_algo"]) == ("NVFP4", 16, None)
    assert "lm_head" in q["exclude_modules"]
    assert ("model.layers.*.mlp.gate" in q["exclude_modules"]) == (arch == "qwen3_moe")


@pytest.mark.parametrize("arch", ARCHS)
def test_compressed_tensors_config_is_nvfp4_pack_quantized(written, arch):
    cfg = json.loads((Path(written[(arch, "compressed-tensors")]["out_dir"]) /
                      "config.json").read_text())
    q = cfg["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "nvfp4-pack-quantized")
    assert (r"re:.*mlp\.gate$" in q["ignore"]) == (arch == "qwen3_moe")
    assert not (Path(written[(arch, "compressed-tensors")]["out_dir"]) /
                "hf_quant_config.json").exists()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_exclude_lists_keep_every_linear_but_the_experts_bf16(written, arch, fmt):
    """vLLM's own matchers on every Linear prefix the model builds (the load test proves the
    same through the model class)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.utils import should_ignore_layer
    from vllm.model_executor.layers.quantization.modelopt import ModelOptNvFp4Config

    m = written[(arch, fmt)]
    cfg = m["config"]
    fused = {"gate_up_proj": ["gate_proj", "up_proj"],
             "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"],
             "qkv_proj": ["q_proj", "k_proj", "v_proj"]}
    attn = (["fused_qkv_a_proj", "q_b_proj", "kv_b_proj", "o_proj"] if arch == "deepseek_v3"
            else ["qkv_proj", "o_proj"])
    moe = {int(entry["layer"].split(".")[2]) for entry in m["layers"]}
    prefixes = []
    for i in range(cfg["num_hidden_layers"]):
        prefixes += [f"model.layers.{i}.self_attn.{a}" for a in attn]
        if i not in moe:
            prefixes += [f"model.layers.{i}.mlp.gate_up_proj", f"model.layers.{i}.mlp.down_proj"]
        elif arch == "deepseek_v3":
            prefixes += [f"model.layers.{i}.mlp.shared_experts.gate_up_proj",
                         f"model.layers.{i}.mlp.shared_experts.down_proj"]
        else:
            prefixes.append(f"model.layers.{i}.mlp.gate")
    if fmt == "modelopt":
        qc = ModelOptNvFp4Config.from_config(m["hf_quant_config"])
        qc.packed_modules_mapping = fused
        excluded = {p: qc.is_layer_excluded(p) for p in prefixes}
    else:
        ignore = cfg["quantization_config"]["ignore"]
        excluded = {p: should_ignore_layer(p, ignore=ignore, fused_mapping=fused)
                    for p in prefixes}
    assert all(excluded.values()), [p for p, v in excluded.items() if not v]


def test_sharded_checkpoint_has_an_index_and_the_same_tensors(written, tmp_path):
    single = written[("qwen3_moe", "compressed-tensors")]
    sharded = write_checkpoint(tmp_path / "sharded", fmt="compressed-tensors", arch="qwen3_moe",
                               shard_size_bytes=2 * 1024 * 1024)
    root = Path(sharded["out_dir"])
    shards = sorted(p.name for p in root.glob("*.safetensors"))
    assert len(shards) >= 3 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    weight_map = json.loads((root / "model.safetensors.index.json").read_text())["weight_map"]
    a, b = _tensors(single), _tensors(sharded)
    assert set(weight_map) == set(a) == set(b)
    assert set(weight_map.values()) == set(shards)
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name


@pytest.mark.parametrize("kwargs, match", [
    ({"fmt": "gguf", "arch": "qwen3_moe"}, "unknown checkpoint format"),
    ({"fmt": "modelopt", "arch": "llama"}, "unknown arch"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "hidden_sizes": 512}, "unknown size override"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "hidden_size": 100}, "hidden_size=100"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "input_scale_spread": 1.1}, "float32"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "input_scale_spread": 0.5}, ">= 1"),
    ({"fmt": "modelopt", "arch": "deepseek_v3", "n_routed_experts": 6}, "n_group"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "input_scale_spread": 1e9}, "exceeds 229376"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "input_scale_spread": float("inf")}, "finite"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "num_experts": "8"}, "non-negative integer"),
    ({"fmt": "modelopt", "arch": "qwen3_moe", "hidden_size": 65536}, "GiB"),
])
def test_bad_arguments_are_named(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_checkpoint(tmp_path / "c", **kwargs)


def test_refuses_a_non_empty_directory_unless_overwrite(tmp_path):
    out = tmp_path / "c"
    write_checkpoint(out, fmt="modelopt", arch="qwen3_moe", **SMALL)
    with pytest.raises(FileExistsError, match="overwrite=True"):
        write_checkpoint(out, fmt="modelopt", arch="qwen3_moe", **SMALL)
    write_checkpoint(out, fmt="compressed-tensors", arch="qwen3_moe", overwrite=True, **SMALL)
    assert not (out / "hf_quant_config.json").exists(), "stale files of the old write are gone"
