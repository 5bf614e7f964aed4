# SPDX-License-Identifier: Apache-2.0
"""Each NVFP4 MoE family's tiny model quantized by the real quantizers: llmcompressor's NVFP4
scheme (compressed-tensors) and NVIDIA ModelOpt's NVFP4 export, routed experts only.

Why: lab/fp4_moe_lab/checkpoint/families.py writes the families' checkpoints with the project's
own quantizer, under the names we read the exports to have. What llmcompressor and ModelOpt
write for each architecture (whether they quantize its experts at all: transformers 5 keeps
them stacked in 3D parameters, not ``nn.Linear``; under which names; with which scales) is the
field's truth, and ``audit`` / ``doctor`` must read it.

The bf16 model is the family's transformers class with the writer's tiny config and random
weights (families.FAMILIES); calibration is 32 random token sequences; llmcompressor with
``moe_calibrate_all_experts`` on (its default) and off (``-routed``: each expert calibrated on
its routed tokens, so their input scales differ); ModelOpt's forward loop is the model's own.
A family a quantizer cannot handle is recorded with its error, not skipped.

Usage: .venv-quant/bin/python accuracy/quantize_families.py [--family F ...] [--out DIR]
(default accuracy/models/families/<family>-<quantizer>/, each file cut to the experts'
tensors as written: :func:`keep_experts_only`; a summary in
accuracy/results/families-real-quantizers.json). On the CPU, under a minute.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import traceback

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "lab"), os.path.join(HERE, "..")]  # lab, its plugin
from fp4_moe_lab.checkpoint.families import (  # noqa: E402  (the lab, from the checkout)
    CT_IGNORE_ALL_BUT_EXPERTS,
    FAMILIES,
)

SEQUENCES, SEQ_LEN = 32, 16
SUMMARY = os.path.join(HERE, "results", "families-real-quantizers.json")
TOKENIZER = os.path.join(HERE, "tokenizer")


def bf16_model(family: str, out: str) -> None:
    """The family's transformers model, random weights (seed 0), saved in bf16 to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fam = FAMILIES[family]
    cfg = AutoConfig.for_model(fam.model_type, **copy.deepcopy(fam.config))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)


def calibration(vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(777)
    return torch.randint(2, vocab, (SEQUENCES, SEQ_LEN), generator=g)


def with_llmcompressor(bf16: str, out: str, all_experts: bool = True) -> dict:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modeling.moe.linearize import load_quantizable_moe
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with load_quantizable_moe():
        model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    ids = calibration(model.config.vocab_size)
    ds = Dataset.from_dict({"input_ids": ids.tolist(),
                            "attention_mask": torch.ones_like(ids).tolist()})
    recipe = QuantizationModifier(targets="Linear", scheme="NVFP4",
                                  ignore=[CT_IGNORE_ALL_BUT_EXPERTS])
    tok = AutoTokenizer.from_pretrained(TOKENIZER)  # asked for; the dataset is token ids
    oneshot(model=model, dataset=ds, recipe=recipe, processor=tok,
            num_calibration_samples=SEQUENCES,
            max_seq_length=SEQ_LEN, moe_calibrate_all_experts=all_experts,
            shuffle_calibration_samples=False)
    model.save_pretrained(out, save_compressed=True)
    return {"recipe": "QuantizationModifier(targets=Linear, scheme=NVFP4, ignore=all but "
                      f"experts), moe_calibrate_all_experts={all_experts}"}


def with_modelopt(bf16: str, out: str) -> dict:
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    ids = calibration(model.config.vocab_size)

    def forward_loop(m):
        with torch.no_grad():
            for row in ids:
                m(input_ids=row[None])

    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    # routed experts only (ModelOpt 0.47: a list of rules, later ones win, "*" off first): the
    # weight and input quantizers' rules narrowed to modules under ".experts"
    for rule in cfg["quant_cfg"]:
        if rule.get("quantizer_name") in ("*weight_quantizer", "*input_quantizer"):
            rule["quantizer_name"] = "*experts*" + rule["quantizer_name"][1:]
    model = mtq.quantize(model, cfg, forward_loop=forward_loop)
    export_hf_checkpoint(model, export_dir=out)
    return {"config": "NVFP4_DEFAULT_CFG, quantizers outside '*experts*' disabled"}


def keep_experts_only(out: str) -> int:
    """Drop every tensor outside the experts (bf16 attention, embeddings, norms, routers: the
    writer's, not the quantizer's) from the written file, to keep the repository small: what
    audit and doctor read, the experts' tensors and the configs, stays exactly as written.
    Returns the number of tensors dropped."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = os.path.join(out, "model.safetensors")
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        names = list(f.keys())
        kept = {n: f.get_tensor(n) for n in names if ".experts" in n or "_experts" in n}
    save_file(kept, path, metadata=meta)
    return len(names) - len(kept)


# llmcompressor both ways people calibrate: every expert on every token (its default: one
# input scale per layer), and each expert on its routed tokens only (scales that differ)
QUANTIZERS = {"llmcompressor": with_llmcompressor,
              "llmcompressor-routed": lambda bf16, out: with_llmcompressor(bf16, out, False),
              "modelopt": with_modelopt}


def versions() -> dict:
    import importlib.metadata as md

    return {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "nvidia-modelopt",
                                       "transformers", "torch")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", action="append", choices=tuple(FAMILIES))
    ap.add_argument("--quantizer", action="append", choices=tuple(QUANTIZERS))
    ap.add_argument("--out", default=os.path.join(HERE, "models", "families"))
    args = ap.parse_args()
    summary = {"versions": versions(), "runs": {}}
    if os.path.exists(SUMMARY):
        summary["runs"] = json.load(open(SUMMARY)).get("runs", {})
    for family in args.family or FAMILIES:
        with tempfile.TemporaryDirectory() as bf16:
            bf16_model(family, bf16)
            for name in args.quantizer or QUANTIZERS:
                out = os.path.join(args.out, f"{family}-{name}")
                t0 = time.time()
                try:
                    info = {"ok": True, **QUANTIZERS[name](bf16, out)}
                    info["tensors_dropped_outside_experts"] = keep_experts_only(out)
                except Exception as exc:  # the record of what the quantizer does with it
                    info = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:600],
                            "where": traceback.format_exc().splitlines()[-3:]}
                info["seconds"] = round(time.time() - t0, 1)
                summary["runs"][f"{family}-{name}"] = info
                if info["ok"]:  # beside the weights, as accuracy/models' other checkpoints
                    with open(os.path.join(out, "quantize-log.json"), "w") as f:
                        json.dump({**info, "family": family, "quantizer": name,
                                   "calibration": f"{SEQUENCES} x {SEQ_LEN} random token ids, "
                                                  "seed 777", "versions": versions()}, f, indent=1)
                        f.write("\n")
                print(f"[families] {family} / {name}: "
                      f"{'ok' if info['ok'] else info['error'][:200]}", flush=True)
    summary["versions"] = versions()
    with open(SUMMARY, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
