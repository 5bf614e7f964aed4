# SPDX-License-Identifier: Apache-2.0
"""The audit on each NVFP4 MoE family's checkpoint names (vLLM 0.34.0's model files say which:
docs/SUPPORT.md, families): routed experts found under the family's module path and projection
names, non-gated experts (one GEMM1 projection) judged as such, shared experts left out, the
expert count read where the family's config keeps it, stacked expert tensors refused by name."""

import pytest

from tests.checkpoint.synthetic import SCALE, write_scales_only
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint
from vllm_fp4_moe_plugin.tools.checkpoint.tensor_index import CheckpointAuditError
from vllm_fp4_moe_plugin.tools.cli import FORMATS

E = 8
# family: (config.json, routed-expert prefix, projections, a shared expert's scale tensors)
FAMILIES = {
    "glm4_moe": ({"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
                  "n_routed_experts": E, "n_shared_experts": 1, "first_k_dense_replace": 1},
                 "model.layers.1.mlp.experts", ("gate_proj", "up_proj", "down_proj"),
                 "model.layers.1.mlp.shared_experts.{}"),
    "minimax_m2": ({"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2",
                    "num_local_experts": E},
                   "model.layers.0.block_sparse_moe.experts", ("w1", "w3", "w2"), None),
    "nemotron_h": ({"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                    "n_routed_experts": E, "mlp_hidden_act": "relu2"},
                   "backbone.layers.1.mixer.experts", ("up_proj", "down_proj"),
                   "backbone.layers.1.mixer.shared_experts.{}"),
    "llama4": ({"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                "text_config": {"num_local_experts": E, "model_type": "llama4_text"}},
               "language_model.model.layers.0.feed_forward.experts",
               ("gate_proj", "up_proj", "down_proj"),
               "language_model.model.layers.0.feed_forward.shared_expert.{}"),
    "qwen3_next": ({"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
                    "num_experts": E},
                   "model.layers.0.mlp.experts", ("gate_proj", "up_proj", "down_proj"),
                   "model.layers.0.mlp.shared_expert.{}"),
}


def _write(root, fmt, family, w13=None, w2=None):
    config, prefix, projs, shared = FAMILIES[family]
    stored = (lambda v: 1 / v) if fmt == "compressed-tensors" else (lambda v: v)
    w13 = [stored(v) for v in (w13 or [0.25] * E)]
    w2 = [stored(v) for v in (w2 or [16.0] * E)]
    extra = () if shared is None else tuple(
        shared.format(f"{p}.{SCALE[fmt]}") for p in projs)  # calibrated or not: not routed
    write_scales_only(root, fmt, {prefix: (w13, w2)}, projs=projs, config=dict(config),
                      extra=extra)
    return prefix


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_routed_experts_are_audited(tmp_path, fmt, family):
    prefix = _write(tmp_path, fmt, family)
    report = audit_checkpoint(tmp_path, design=Design.NVFP4_ORACLE)
    (layer,) = report["layers"]
    gated = len(FAMILIES[family][2]) == 3
    assert layer["layer"] == prefix and layer["num_experts"] == E
    assert layer["gated"] is gated and report["non_gated_layers"] == (not gated)
    # every routed expert's input and weight global scale, per projection; no shared expert's
    assert report["num_scale_tensors_read"] == E * len(FAMILIES[family][2]) * 2
    assert not layer["uncalibrated_w13"] and not layer["missing_w13"]
    assert not layer["weight_gate_up_split"] and report["affected_layers"] == 0
    assert report["summary"].startswith("not affected")


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_non_gated_experts_only_gemm1_projection_is_judged(tmp_path, fmt):
    """Nemotron-H's up_proj is vLLM's only w13 shard: an uncalibrated one is named there (an
    audit that expected a gate_proj would call every expert uncalibrated instead)."""
    dead = [0.25] * E
    dead[5] = 0.25 * 1e-30
    _write(tmp_path, fmt, "nemotron_h", w13=dead)
    report = audit_checkpoint(tmp_path, design=Design.NVFP4_ORACLE)
    (layer,) = report["layers"]
    assert layer["uncalibrated_w13"] == [5] and layer["missing_w13"] == []
    assert layer["uncalibrated_w2"] == []


@pytest.mark.parametrize("name", [
    "language_model.model.layers.0.feed_forward.experts.gate_up_proj",  # Llama-4 (BF16, FP8)
    "model.layers.0.mlp.experts.gate_up_proj_weight_scale_2",  # a stacked NVFP4 scale
    "model.layers.0.mlp.experts.down_proj.weight",
])
def test_stacked_expert_tensors_are_refused_by_name(tmp_path, name):
    _write(tmp_path, "modelopt", "qwen3_next")
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(index.read_text().replace('"weight_map": {',
                                               f'"weight_map": {{"{name}": "x.safetensors", '))
    with pytest.raises(CheckpointAuditError, match=r"stacked expert tensors \(" + name):
        audit_checkpoint(tmp_path)


def test_a_layer_without_a_down_projection_is_named(tmp_path):
    config, prefix, _, _ = FAMILIES["qwen3_next"]
    write_scales_only(tmp_path, "modelopt", {prefix: ([0.25] * E, [0.25] * E)},
                      projs=("gate_proj", "up_proj"), config=dict(config))
    with pytest.raises(CheckpointAuditError, match=r"lack a down projection \(down_proj\)"):
        audit_checkpoint(tmp_path)


def test_the_expert_count_under_text_config_bounds_the_tensors(tmp_path):
    """Llama-4 keeps num_local_experts under text_config: tensors of a 9th expert are refused."""
    config, prefix, projs, _ = FAMILIES["llama4"]
    write_scales_only(tmp_path, "modelopt", {prefix: ([0.25] * (E + 1), [16.0] * (E + 1))},
                      projs=projs, config=dict(config))
    with pytest.raises(CheckpointAuditError, match="num_local_experts=8"):
        audit_checkpoint(tmp_path)
