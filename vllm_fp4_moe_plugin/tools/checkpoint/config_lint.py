# SPDX-License-Identifier: Apache-2.0
"""Config keys that the checkpoint's own readers get wrong before any scale matters: what
transformers 4 reads under other names than transformers 5 writes, and what compressed-tensors
0.11.0 refuses. Each finding names the key to add or remove; the files are never rewritten."""

from __future__ import annotations

import json
from typing import Optional

# transformers 5 writes some config keys under new names and reads both; transformers 4 (the one
# vLLM 0.11.0 to 0.13.x run with) reads only the old name and silently takes its default
# (measured with transformers 4.57.1 on a Qwen3-MoE config that transformers 5.17 wrote:
# num_experts 128 instead of 8, rope_theta 10000.0 instead of 1e6). model types -> (new key,
# old key, transformers 4's default).
RENAMED_KEYS = {
    ("qwen3_moe", "qwen2_moe"): (("num_local_experts", "num_experts", 128),),
}
TOKENIZER_CLASSES_T5_ONLY = ("TokenizersBackend",)


def transformers4_misreads(config: dict, tokenizer_config: Optional[dict] = None) -> list[str]:
    """What a transformers-4 reader gets wrong in this checkpoint's JSON, each with the key to
    add (the files are never rewritten)."""
    out = []
    model_type = config.get("model_type")
    for types, renamed in RENAMED_KEYS.items():
        if model_type not in types:
            continue
        for new, old, default in renamed:
            if new in config and old not in config:
                out.append(f"config.json has {new}={config[new]!r} (transformers 5's name) but no "
                           f"{old}: transformers 4 (vLLM 0.11.0 - 0.13.x) reads {old} and "
                           f"falls back to {default}; add \"{old}\": {json.dumps(config[new])}")
    rope = config.get("rope_parameters")
    if isinstance(rope, dict) and "rope_theta" in rope and "rope_theta" not in config:
        out.append("config.json has rope_parameters (transformers 5) but no top-level rope_theta: "
                   "transformers 4 falls back to the model class default (10000.0 for "
                   "Qwen3-MoE) and positions are silently wrong; add \"rope_theta\": "
                   f"{json.dumps(rope['rope_theta'])}")
    cls = (tokenizer_config or {}).get("tokenizer_class")
    if cls in TOKENIZER_CLASSES_T5_ONLY:
        out.append(f"tokenizer_config.json has tokenizer_class {cls!r}, which transformers 4 "
                   "cannot load (vLLM 0.11.0 - 0.13.x fail at startup); set "
                   "\"tokenizer_class\": \"PreTrainedTokenizerFast\"")
    return out


# Quantization-args fields newer compressed-tensors write that compressed-tensors 0.11.0 (vLLM
# 0.11.0's pin) refuses ("Extra inputs are not permitted"), so vLLM 0.11.0 cannot start with the
# checkpoint (measured on llmcompressor 0.14's output, which writes compressed-tensors 0.19's).
NEWER_QUANT_ARGS = ("scale_dtype", "zp_dtype")


def compressed_tensors_011_refuses(config: dict) -> list[str]:
    """What compressed-tensors 0.11.0 refuses in ``quantization_config``, with the fix."""
    qc = config.get("quantization_config")
    if not isinstance(qc, dict) or qc.get("quant_method") != "compressed-tensors":
        return []
    found = sorted({key for group in (qc.get("config_groups") or {}).values()
                    if isinstance(group, dict)
                    for args in (group.get("weights"), group.get("input_activations"))
                    if isinstance(args, dict) for key in NEWER_QUANT_ARGS if key in args})
    if not found:
        return []
    return [f"config.json quantization_config has {', '.join(found)} in its quantization "
            "args (written by compressed-tensors >= 0.12): compressed-tensors 0.11.0 (vLLM "
            "0.11.0) refuses them and vLLM does not start; remove those keys from "
            "config_groups.*.weights and .input_activations (their values are the NVFP4 "
            "defaults)"]

