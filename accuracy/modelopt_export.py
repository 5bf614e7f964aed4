# SPDX-License-Identifier: Apache-2.0
"""Write the ModelOpt-format NVFP4 checkpoint of the trained addition MoE with NVIDIA ModelOpt.

Why: DeepSeek-R1-FP4 and most published NVFP4 MoE checkpoints are ModelOpt exports
(hf_quant_config.json, per-expert weight_scale_2 / input_scale); the plugin treats that format
on its own code path, so the accuracy checks need one written by ModelOpt itself, calibrated
on the same training-distribution prompts as accuracy/quantize.py.

Usage: .venv-quant/bin/python accuracy/modelopt_export.py [--out DIR] [--samples N]
Calls only ModelOpt's public API: mtq.quantize(model, NVFP4_DEFAULT_CFG, forward_loop) and
modelopt.torch.export.export_hf_checkpoint. On the CPU, in .venv-quant.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import time

import torch
from quantize import calib_texts, copy_tokenizer  # the sibling script

HERE = os.path.dirname(os.path.abspath(__file__))


def dual_config(out_dir: str, bf16_dir: str) -> list[str]:
    """Give the exported config.json the transformers-4 spellings it lacks.

    ModelOpt's exporter writes the config as transformers 5 holds it (num_local_experts,
    rope_parameters); transformers 4.57, and so vLLM 0.11.0, would read num_experts=128 and no
    rope_theta from it. We add the bf16 model's keys that are missing (num_experts, rope_theta,
    ...), touching nothing ModelOpt wrote, and keep ModelOpt's own file as
    config.modelopt-as-written.json (evidence, not loaded).
    """
    path = os.path.join(out_dir, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(os.path.join(out_dir, "config.modelopt-as-written.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(bf16_dir, "config.json")) as f:
        ref = json.load(f)
    added = [k for k in ref if k not in cfg]
    cfg.update({k: ref[k] for k in added})
    with open(path, "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    return added


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bf16-dir", default=os.path.join(HERE, "models", "qwen3moe-add-bf16"))
    ap.add_argument("--out", default=os.path.join(HERE, "models", "qwen3moe-add-nvfp4-modelopt"))
    ap.add_argument("--samples", type=int, default=512)
    args = ap.parse_args()

    import modelopt
    import modelopt.torch.quantization as mtq
    import transformers
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(args.bf16_dir)
    model = AutoModelForCausalLM.from_pretrained(args.bf16_dir, dtype=torch.bfloat16)
    texts = calib_texts(args.samples)

    def forward_loop(m):
        with torch.no_grad():
            for t in texts:
                m(**tok(t, return_tensors="pt"))

    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    model = mtq.quantize(model, cfg, forward_loop=forward_loop)
    export_hf_checkpoint(model, export_dir=args.out)
    copy_tokenizer(args.bf16_dir, args.out)
    added = dual_config(args.out, args.bf16_dir)
    info = {"modelopt": modelopt.__version__, "transformers": transformers.__version__,
            "torch": torch.__version__, "config": "NVFP4_DEFAULT_CFG",
            "n_calibration": len(texts), "config_keys_added": added,
            "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(args.out, "quantize-log.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    print(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()
