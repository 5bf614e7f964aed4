# SPDX-License-Identifier: Apache-2.0
"""config.json and quantization dicts of the tiny NVFP4 MoE checkpoints
(docs/NVFP4-FORMAT.md §1-2, §5).

Only the routed experts are NVFP4. Everything else stays bf16 through exclude/ignore lists, for
two reasons: the bug under study lives in the MoE layers only, and vLLM 0.11.0 cannot even
construct an NVFP4 *Linear* method without SM100/Marlin (modelopt.py:848-863), so a bf16
remainder keeps the checkpoints loadable in more places.
"""

from __future__ import annotations

import copy

ARCHS = ("deepseek_v3", "qwen3_moe")

# The quantization_config of an NVFP4 compressed-tensors checkpoint, as llm-compressor writes it;
# the writer and the simulated layer (simulation/moe_layer.py) both use it.
COMPRESSED_TENSORS_NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                    "group_size": 16, "symmetric": True, "dynamic": False},
        "input_activations": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                              "group_size": 16, "symmetric": True, "dynamic": "local"},
    }},
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
}

# Every size key is set: vLLM's DeepseekV3Config defaults are the 671B model's
# (vllm/transformers_utils/configs/deepseek_v3.py:14-55). kv_lora_rank + qk_rope_head_dim must be
# 576 for every MLA backend (vllm/v1/attention/backends/mla/common.py:298-310). hidden 256 keeps
# the checkpoint under ~10 MB (docs/NVFP4-FORMAT.md §5): MLA's kv_a/kv_b projections are fixed-size.
_COMMON = {  # keys both tiny configs share
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "use_cache": True,
    "torch_dtype": "bfloat16",
}

DEEPSEEK_V3 = {
    **_COMMON,
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "ep_size": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "num_nextn_predict_layers": 0,  # else layer num_hidden_layers is skipped as MTP
}

QWEN3_MOE = {
    **_COMMON,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "max_position_embeddings": 2048,
    "use_sliding_window": False,
    "sliding_window": None,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
}

BASE_CONFIGS = {"deepseek_v3": DEEPSEEK_V3, "qwen3_moe": QWEN3_MOE}

# Keys that change the tensor layout; everything else in a base config may be overridden too.
NUM_EXPERTS_KEY = {"deepseek_v3": "n_routed_experts", "qwen3_moe": "num_experts"}

MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.23.0"}


def check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHS}")


def model_config(arch: str, overrides: dict) -> dict:
    """The base config of ``arch`` with ``overrides`` (config.json keys) applied."""
    check_arch(arch)
    cfg = copy.deepcopy(BASE_CONFIGS[arch])
    unknown = sorted(set(overrides) - set(cfg))
    if unknown:
        raise ValueError(f"unknown size override(s) {unknown} for arch {arch!r}; "
                         f"allowed keys are the config.json keys {sorted(cfg)}")
    cfg.update(copy.deepcopy(overrides))
    return cfg


def moe_layer_indices(arch: str, cfg: dict) -> list[int]:
    """Decoder layers whose MLP is a routed MoE, by the model file's own rule."""
    n = cfg["num_hidden_layers"]
    if arch == "deepseek_v3":  # deepseek_v2.py:1034-1049
        return [i for i in range(n) if i >= cfg["first_k_dense_replace"]
                and i % cfg["moe_layer_freq"] == 0]
    # qwen3_moe.py Qwen3MoeDecoderLayer: not in mlp_only_layers and (i+1) % decoder_sparse_step == 0
    return [i for i in range(n) if i not in cfg["mlp_only_layers"]
            and cfg["num_experts"] > 0 and (i + 1) % cfg["decoder_sparse_step"] == 0]


def _dense_mlp_names(arch: str, cfg: dict) -> list[str]:
    moe = set(moe_layer_indices(arch, cfg))
    return [f"model.layers.{i}.mlp.{proj}" for i in range(cfg["num_hidden_layers"])
            if i not in moe for proj in ("gate_proj", "up_proj", "down_proj")]


def modelopt_exclude_modules(arch: str, cfg: dict) -> list[str]:
    """``exclude_modules``, matched as vLLM 0.11.0 does (modelopt.py:790-808,
    quant_utils.py:265-304).

    * ``model.layers.*.self_attn*`` becomes the regex ``model\\.layers\\..*\\.self_attn.*`` and is
      fullmatched against the *vLLM* prefix, so it also catches the fused ``fused_qkv_a_proj`` /
      ``qkv_proj`` (whose shard names are not listed, so the exact-shard check stays consistent).
    * Dense MLPs are listed by exact checkpoint shard name: the fused ``gate_up_proj`` is then
      skipped because *both* of its shards are listed.
    * DeepSeek shared experts: ``...shared_experts*`` fullmatches ``gate_up_proj`` and
      ``down_proj`` under it; ``FusedMoE`` is never excluded (modelopt.py:822-823) anyway.
    * Qwen3-MoE's router receives the quant config (qwen3_moe.py:156-160):
      ``model.layers.*.mlp.gate`` fullmatches only the router, never ``gate_proj``/``gate_up_proj``.
    """
    out = ["lm_head", "model.layers.*.self_attn*"]
    if arch == "deepseek_v3" and cfg.get("n_shared_experts"):
        out.append("model.layers.*.mlp.shared_experts*")
    if arch == "qwen3_moe":
        out.append("model.layers.*.mlp.gate")
    return out + _dense_mlp_names(arch, cfg)


def compressed_tensors_ignore(arch: str, cfg: dict) -> list[str]:
    """``ignore`` entries: exact checkpoint names or ``re:`` + a prefix-anchored ``re.match``;
    fused layers are checked shard by shard (vllm/.../compressed_tensors/utils.py:23-70,154-170)."""
    out = ["lm_head", r"re:.*self_attn\..*"]
    if arch == "deepseek_v3" and cfg.get("n_shared_experts"):
        out.append(r"re:.*mlp\.shared_experts\..*")
    if arch == "qwen3_moe":
        out.append(r"re:.*mlp\.gate$")
    return out + _dense_mlp_names(arch, cfg)


def hf_quant_config(arch: str, cfg: dict) -> dict:
    """ModelOpt <= 0.29 ``hf_quant_config.json`` (nested; vLLM 0.11.0 reads all four keys,
    modelopt.py:687-788). config.json must then carry NO ``quantization_config``: it would win
    (transformers_utils/config.py:599-611) and 0.11.0 misreads ModelOpt's newer ``ignore`` key."""
    return {"producer": dict(MODELOPT_PRODUCER),
            "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                             "kv_cache_quant_algo": None,
                             "exclude_modules": modelopt_exclude_modules(arch, cfg)}}


def compressed_tensors_quantization_config(arch: str, cfg: dict) -> dict:
    """llm-compressor's NVFP4 preset as config.json ``quantization_config``
    (docs/NVFP4-FORMAT.md §2)."""
    q = copy.deepcopy(COMPRESSED_TENSORS_NVFP4)
    q["ignore"] = compressed_tensors_ignore(arch, cfg)
    return q
