# SPDX-License-Identifier: Apache-2.0
"""Exact-match accuracy of a HF model directory on the addition test set, on the CPU.

Why: the accuracy table's reference numbers (bf16, and the fake-quantized NVFP4 checkpoints where
the installed compressed-tensors can decompress them) come from plain transformers, greedy, so
an engine's number can be held against them. It also prints what transformers made of the
config (experts, top-k, rope theta) and any weight it did not load, so a config that one
transformers major misreads is caught here rather than as a silently wrong model.

Usage: python accuracy/eval_hf.py MODEL_DIR [--test-jsonl F] [--limit N] [--json OUT]
Works with transformers 4.57 (the repo's .venv) and 5.x (.venv-quant).
Batches hold prompts of one length, so no padding is involved (as in an engine).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def load(model_dir: str, linearize: bool = False):
    import contextlib

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(model_dir)
    kw = {"dtype": torch.bfloat16} if int(transformers.__version__.split(".")[0]) >= 5 \
        else {"torch_dtype": torch.bfloat16}
    ctx = contextlib.nullcontext()
    if linearize:
        # transformers 5 fuses the experts into 3-D tensors and then drops every per-expert
        # global scale of a compressed-tensors checkpoint ("UNEXPECTED" keys; garbage out):
        # llmcompressor's loader keeps one Linear per expert, so each gets its own scales.
        from llmcompressor.modeling.moe.linearize import load_quantizable_moe
        ctx = load_quantizable_moe()
    with ctx:
        if linearize:   # its patched from_pretrained wants the model alone back
            model, info = AutoModelForCausalLM.from_pretrained(model_dir, **kw), {}
        else:
            model, info = AutoModelForCausalLM.from_pretrained(model_dir,
                                                               output_loading_info=True, **kw)
    model.eval()
    return tok, model, info


def describe(tok, model, info) -> dict:
    import transformers
    c = model.config
    rope = getattr(c, "rope_theta", None)
    if rope is None and isinstance(getattr(c, "rope_parameters", None), dict):
        rope = c.rope_parameters.get("rope_theta")
    # the first MoE layer (DeepSeek-V3's first layers are dense)
    moe = next(layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "experts"))
    experts = getattr(moe, "num_experts", None) or getattr(moe.experts, "num_experts", None) \
        or len(moe.experts)
    quant = getattr(c, "quantization_config", None)
    return {
        "transformers": transformers.__version__,
        "tokenizer_class": type(tok).__name__,
        "bos/eos/pad": [tok.bos_token_id, tok.eos_token_id, tok.pad_token_id],
        "config.num_experts": getattr(c, "num_experts", None),
        "experts_built_in_first_moe_layer": experts,
        "num_experts_per_tok": c.num_experts_per_tok,
        "rope_theta": rope,
        "model_class": type(model).__name__,
        "quantized": quant is not None,
        "missing_keys": list(info.get("missing_keys", [])),
        "unexpected_keys": list(info.get("unexpected_keys", []))[:8],
        "mismatched_keys": [str(x) for x in info.get("mismatched_keys", [])][:8],
    }


@torch.no_grad()
def exact_match(tok, model, problems, batch: int = 256, max_new: int = 6):
    by_len: dict[int, list] = {}
    for p, a in problems:
        by_len.setdefault(len(p), []).append((p, a))
    good, wrong = 0, []
    for _, group in sorted(by_len.items()):
        for s in range(0, len(group), batch):
            chunk = group[s:s + batch]
            enc = tok([p for p, _ in chunk], return_tensors="pt")
            out = model.generate(**enc, max_new_tokens=max_new, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
            gen = out[:, enc["input_ids"].shape[1]:]
            for (p, a), row in zip(chunk, gen.tolist()):
                stopped = tok.eos_token_id in row
                text = tok.decode(row[: row.index(tok.eos_token_id)] if stopped else row,
                                  skip_special_tokens=True)
                if stopped and text == a:
                    good += 1
                elif len(wrong) < 5:
                    wrong.append({"prompt": p, "want": a, "got": text, "eos": stopped})
    return good / len(problems), wrong


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir")
    ap.add_argument("--test-jsonl", default=os.path.join(here, "data", "addition-test.jsonl"))
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--json", default="")
    ap.add_argument("--linearize", action="store_true",
                    help="load with llmcompressor's per-expert Linear experts (.venv-quant)")
    args = ap.parse_args()
    torch.manual_seed(0)
    with open(args.test_jsonl) as f:
        problems = [(d["prompt"], d["answer"]) for d in map(json.loads, f)]
    if args.limit:
        problems = problems[: args.limit]
    t0 = time.time()
    tok, model, info = load(args.model_dir, args.linearize)
    res = describe(tok, model, info)
    res["model_dir"] = args.model_dir
    res["linearized_experts"] = args.linearize
    res["n"] = len(problems)
    res["exact_match"], res["first_wrong"] = exact_match(tok, model, problems)
    res["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
