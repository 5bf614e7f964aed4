# SPDX-License-Identifier: Apache-2.0
"""Write the compressed-tensors NVFP4 checkpoints of the trained addition MoE with llmcompressor.

Why: the plugin's bugs live in how vLLM uses the per-expert activation global scales that a
real quantizer writes. These checkpoints are what llmcompressor 0.14.0.1 writes for the
NVFP4 scheme (QuantizationModifier, targets Linear, lm_head and the router mlp.gate ignored),
calibrated on prompts of the TRAINING distribution (accuracy/task.py's sampler, which never
yields a test pair), in the calibration modes people use:

  all     moe_calibrate_all_experts=True (llmcompressor's default): every expert sees every
          calibration token, so all experts of a layer get the same gate/up input scale
  routed  moe_calibrate_all_experts=False: each expert sees only the tokens routed to it, so
          the experts' input scales differ (the case stock vLLM mishandles)
  dead    routed, with a deliberately tiny calibration set chosen so that, in the bf16 model's
          routing, exactly one expert of one layer gets no calibration token (llmcompressor's
          own calibration pass, which quantizes as it goes, routed differently and left three
          experts without tokens: accuracy/README.md). llmcompressor warns "Attempted to
          calibrate a module input without statistics" and writes what it writes: the scale
          tensor's uninitialised memory (values change from run to run; sibling issue)

The DeepSeek-V3 model (--bf16-dir accuracy/models/deepseekv3-add-bf16, modes all/routed) is
quantized with the routed experts only: its recipe also ignores the MLA attention, the shared
experts and the dense first layer's MLP (all Linear; the CPU platform has no NVFP4 dense-linear
kernel, accuracy/experts_only.py), so the file llmcompressor writes is served as written.

Usage: .venv-quant/bin/python accuracy/quantize.py {all,routed,dead} [--out DIR]
          [--samples N] [--bf16-dir accuracy/models/qwen3moe-add-bf16]
Runs on the CPU in .venv-quant (scripts/bootstrap-quant.sh): 1 min (64 samples, idle CPU) to
35 min (512 samples routed, 2 cores shared with other jobs).
"""
from __future__ import annotations

import argparse
import json
import os
import time

import task  # the sibling accuracy/task.py: this file runs as a script
import torch

HERE = os.path.dirname(os.path.abspath(__file__))

CALIB_SEED = 777          # calibration draws: a stream of its own from the training sampler
DEFAULT_OUT = {
    "all": "qwen3moe-add-nvfp4-ct-all",
    "routed": "qwen3moe-add-nvfp4-ct-routed",
    "dead": "qwen3moe-add-nvfp4-ct-routed-dead",
}
OUT_PREFIX = {"qwen3_moe": "qwen3moe-add-nvfp4-", "deepseek_v3": "deepseekv3-add-nvfp4-"}


def ignore_list(cfg: dict) -> list[str]:
    """What the recipe leaves unquantized: lm_head and the router (as llmcompressor's MoE
    examples do); for DeepSeek-V3 also every Linear outside the routed experts (module doc)."""
    ignore = ["lm_head", "re:.*mlp.gate$"]
    if cfg["model_type"] == "deepseek_v3":
        ignore += ["re:.*self_attn.*", "re:.*shared_experts.*"]
        ignore += [f"re:model\\.layers\\.{i}\\.mlp\\..*"
                   for i in range(cfg["first_k_dense_replace"])]
    return ignore


def calib_texts(n: int, seed: int = CALIB_SEED) -> list[str]:
    """Whole training-distribution sequences, prompt + answer + <eos>: the tokens an engine
    runs through the experts while it answers (prefill and every decode step)."""
    gen = task.train_sampler(seed)
    out = []
    for _ in range(n):
        a, b = next(gen)
        out.append(task.prompt(a, b) + task.answer(a, b) + task.EOS)
    return out


def routed_counts(model, tok, texts) -> dict[int, list[int]]:
    """Tokens each expert gets (top-k) per layer when the bf16 model reads `texts`."""
    counts: dict[int, list[int]] = {}
    hooks = []
    for li, layer in enumerate(model.model.layers):
        if not hasattr(layer.mlp, "gate"):
            continue  # DeepSeek-V3's dense first layer

        def hook(mod, inp, out, li=li):
            n = mod.num_experts if hasattr(mod, "num_experts") else out[0].shape[-1]
            c = torch.bincount(out[2].reshape(-1), minlength=n).tolist()
            counts[li] = [x + y for x, y in zip(counts.get(li, [0] * n), c)]
        hooks.append(layer.mlp.gate.register_forward_hook(hook))
    with torch.no_grad():
        for t in texts:
            model(**tok(t, return_tensors="pt"))
    for h in hooks:
        h.remove()
    return counts


def pick_dead_set(model, tok, pool: int = 400, max_size: int = 6):
    """A few training problems after which exactly one (layer, expert) has no token and every
    other expert has at least one; greedy over a deterministic pool."""
    texts = calib_texts(pool, seed=CALIB_SEED + 1)
    per = [routed_counts(model, tok, [t]) for t in texts]
    layers = sorted(per[0])
    n_exp = len(per[0][layers[0]])
    tot = {li: [sum(p[li][e] for p in per) for e in range(n_exp)] for li in layers}
    # the rarest expert overall is the one to leave out
    victim = min(((li, e) for li in layers for e in range(n_exp)), key=lambda k: tot[k[0]][k[1]])
    ok = [i for i, p in enumerate(per) if p[victim[0]][victim[1]] == 0]
    chosen: list[int] = []
    covered = {(li, e) for li in layers for e in range(n_exp)} - {victim}
    while covered and len(chosen) < max_size:
        best = max(ok, key=lambda i: sum(1 for (li, e) in covered if per[i][li][e] > 0))
        gain = {(li, e) for (li, e) in covered if per[best][li][e] > 0}
        if not gain:
            break
        chosen.append(best)
        covered -= gain
    return [texts[i] for i in chosen], victim, sorted(covered)


def copy_tokenizer(src: str, dst: str) -> None:
    """The bf16 model's tokenizer files, byte for byte: transformers 5's save_pretrained would
    write tokenizer_class "TokenizersBackend", which transformers 4.57 (vLLM 0.11.0) cannot load."""
    import shutil
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(os.path.join(src, name), os.path.join(dst, name))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=sorted(DEFAULT_OUT))
    ap.add_argument("--bf16-dir", default=os.path.join(HERE, "models", "qwen3moe-add-bf16"))
    ap.add_argument("--out", default="")
    ap.add_argument("--samples", type=int, default=512)
    args = ap.parse_args()
    with open(os.path.join(args.bf16_dir, "config.json")) as f:
        cfg = json.load(f)
    out_dir = args.out or os.path.join(HERE, "models", DEFAULT_OUT[args.mode].replace(
        OUT_PREFIX["qwen3_moe"], OUT_PREFIX[cfg["model_type"]]))

    import compressed_tensors
    import llmcompressor
    import transformers
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.bf16_dir)
    info: dict = {"mode": args.mode, "llmcompressor": llmcompressor.__version__,
                  "compressed_tensors": compressed_tensors.__version__,
                  "transformers": transformers.__version__, "torch": torch.__version__}
    if args.mode == "dead":
        ref = AutoModelForCausalLM.from_pretrained(args.bf16_dir, dtype=torch.bfloat16)
        texts, victim, uncovered = pick_dead_set(ref, tok)
        info["dead_expert_bf16_routing"] = {"layer": victim[0], "expert": victim[1]}
        info["other_experts_without_tokens"] = uncovered
        info["routed_counts_bf16"] = routed_counts(ref, tok, texts)
        del ref
    else:
        texts = calib_texts(args.samples)
    info["calibration_texts"] = texts if len(texts) <= 16 else texts[:4] + ["..."]
    info["n_calibration"] = len(texts)
    enc = [tok(t) for t in texts]
    ds = Dataset.from_dict({"input_ids": [e["input_ids"] for e in enc],
                            "attention_mask": [e["attention_mask"] for e in enc]})

    with load_quantizable_moe():
        model = AutoModelForCausalLM.from_pretrained(args.bf16_dir, dtype=torch.bfloat16)
    info["ignore"] = ignore_list(cfg)
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4", ignore=info["ignore"])
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(texts),
            max_seq_length=32, moe_calibrate_all_experts=(args.mode == "all"),
            shuffle_calibration_samples=False)
    model.save_pretrained(out_dir, save_compressed=True)
    copy_tokenizer(args.bf16_dir, out_dir)
    info["seconds"] = round(time.time() - t0, 1)
    with open(os.path.join(out_dir, "quantize-log.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    print(json.dumps({k: v for k, v in info.items() if k != "calibration_texts"}, indent=1))


if __name__ == "__main__":
    main()
