# SPDX-License-Identifier: Apache-2.0
"""Written checkpoints load through vLLM 0.11.0's REAL model classes and loader.

One spawned rank (``layouts.spawn``, CPU Blackwell simulation) builds ``DeepseekV3ForCausalLM``
/ ``Qwen3MoeForCausalLM`` from each checkpoint's own config.json via ``ModelConfig`` /
``VllmConfig`` / ``initialize_model``, feeds ``model.load_weights`` with
``DefaultModelLoader``'s safetensors iterator and runs ``process_weights_after_loading``.
The only stand-in beyond the Blackwell seam is the attention backend *name*: UnspecifiedPlatform
returns "" for it, so ``Attention.__init__`` raised ``ValueError: Invalid attention backend for
None`` (see ``tests/checkpoint/vllm_load.py``); no attention runs.
"""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4_moe_lab.checkpoint.writer import write_checkpoint
from fp4_moe_lab.simulation.layouts import LAYOUTS, spawn

from .conftest import ARCHS, FORMATS

pytestmark = pytest.mark.multiproc

MODEL_CLASS = {"deepseek_v3": "DeepseekV3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
QUANTIZATION = {"modelopt": ("modelopt_fp4", "ModelOptNvFp4Config", "ModelOptNvFp4FusedMoE"),
                "compressed-tensors": ("compressed-tensors", "CompressedTensorsConfig",
                                       "CompressedTensorsW4A4MoeMethod")}
# Attention's FP8 KV-cache scales: created by the quant method, absent from a checkpoint
# without FP8 KV cache (they keep their 1.0 defaults).
KV_SCALES = ("k_scale", "v_scale", "q_scale", "prob_scale")
CORRUPT = "model.layers.0.mlp.experts"
GATE_UP = (f"{CORRUPT}.3.gate_proj.input_scale", f"{CORRUPT}.3.up_proj.input_scale")
DROPPED = f"{CORRUPT}.5.down_proj.input_scale"
STRAY = "model.layers.0.self_attn.o_proj.input_scale"  # o_proj is excluded, i.e. bf16


def _corrupted_checkpoint(root: Path) -> str:
    """Loads without any error in vLLM 0.11.0, but wrongly: expert 3's gate and up input scales
    differ (the [e] row keeps only the last, layer.py:1482-1497), expert 5 has no GEMM2 input
    scale (its slot keeps torch.empty garbage), and a scale for a bf16 Linear is silently
    skipped (qwen3_moe.py ignore_suffixes)."""
    m = write_checkpoint(root, fmt="modelopt", arch="qwen3_moe", num_hidden_layers=1,
                         num_experts=8)
    path = Path(m["out_dir"]) / "model.safetensors"
    tensors = load_file(str(path))
    tensors[GATE_UP[0]] = tensors[GATE_UP[0]] * 2
    del tensors[DROPPED]
    tensors[STRAY] = torch.tensor(0.5)
    save_file(tensors, str(path))
    return m["out_dir"]


@pytest.fixture(scope="module")
def loaded(written, tmp_path_factory):
    jobs = {f"{arch}/{fmt}": (fmt, written[(arch, fmt)]["out_dir"])
            for arch in ARCHS for fmt in FORMATS}
    jobs["corrupted"] = ("modelopt", _corrupted_checkpoint(tmp_path_factory.mktemp("bad")))
    results = spawn(LAYOUTS["single"], "tests.checkpoint.jobs:load_checkpoints", jobs)[0]
    for key, res in results.items():
        assert "error" not in res, f"{key}:\n{res.get('error')}"
    return results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_real_model_class_and_quant_config(loaded, arch, fmt):
    res = loaded[f"{arch}/{fmt}"]
    quantization, config_cls, moe_method = QUANTIZATION[fmt]
    assert res["model_class"] == MODEL_CLASS[arch]
    assert (res["quantization"], res["quant_config"]) == (quantization, config_cls)
    assert res["moe_methods"] and set(res["moe_methods"].values()) == {moe_method}
    # exclude_modules / ignore keep every Linear (attention, router, dense, shared) bf16.
    assert res["linear_methods"]
    assert set(res["linear_methods"].values()) == {"UnquantizedLinearMethod"}, {
        k: v for k, v in res["linear_methods"].items() if v != "UnquantizedLinearMethod"}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_checkpoint_tensor_reaches_its_parameter(loaded, written, arch, fmt):
    res = loaded[f"{arch}/{fmt}"]
    assert res["yielded"] == res["num_checkpoint_tensors"] == written[(arch, fmt)]["num_tensors"]
    assert res["unreached"] == {}
    assert res["unfilled"] == []
    assert res["params_not_loaded"], "the KV-scale params exist and are not in the checkpoint"
    assert all(p.rsplit(".", 1)[-1] in KV_SCALES for p in res["params_not_loaded"]), \
        res["params_not_loaded"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_loaded_input_scales_are_the_written_ones(loaded, written, arch, fmt):
    res, m = loaded[f"{arch}/{fmt}"], written[(arch, fmt)]
    assert sorted(res["scales"]) == [entry["layer"] for entry in m["layers"]]
    for entry in m["layers"]:
        got = res["scales"][entry["layer"]]
        stored13 = torch.tensor(entry["w13_stored"])
        stored2 = torch.tensor(entry["w2_stored"])
        # w13_input_scale / w13_input_global_scale [E, 2]: gate and up columns, both written.
        assert got["w13_raw"] == torch.stack([stored13, stored13], 1).tolist()
        assert got["w2_raw"] == stored2.tolist()
        # After processing: per-expert quantization scale (CT sense); ModelOpt: 1/input_scale.
        quant13 = stored13 if fmt == "compressed-tensors" else 1 / stored13
        quant2 = stored2 if fmt == "compressed-tensors" else 1 / stored2
        assert got["w13_input_scale_quant"] == quant13.tolist()
        assert got["w2_input_scale_quant"] == quant2.tolist()


def test_the_coverage_checks_catch_a_silently_wrong_load(loaded):
    res = loaded["corrupted"]
    assert res["model_class"] == "Qwen3MoeForCausalLM", "vLLM itself loads it without complaint"
    assert res["unreached"] == {
        STRAY: "no parameter holds it",
        GATE_UP[0]: "parameter slot holds different values",  # up_proj is yielded last
    }
    assert res["unfilled"] == [DROPPED]
