# SPDX-License-Identifier: Apache-2.0
"""Offline generation with the plugin on a Blackwell host (what `vllm serve` does, in Python).

    VLLM_FP4_MOE_PLUGIN=1 python examples/offline_generate.py --tp 4 --ep
    python examples/offline_generate.py --dry-run     # print the settings, load nothing

The plugin is not imported here: vLLM loads it through its entry point in every process.
"""

import argparse
import os


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="nvidia/DeepSeek-R1-0528-FP4-v2")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--ep", action="store_true", help="enable expert parallelism")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("VLLM_FP4_MOE_PLUGIN", "1")
    os.environ.setdefault("VLLM_USE_FLASHINFER_MOE_FP4", "1")
    os.environ.setdefault("VLLM_FLASHINFER_MOE_BACKEND", "throughput")
    settings = dict(model=args.model, tensor_parallel_size=args.tp,
                    enable_expert_parallel=args.ep, max_model_len=4096)
    if args.dry_run:
        print({k: os.environ[k] for k in ("VLLM_FP4_MOE_PLUGIN", "VLLM_USE_FLASHINFER_MOE_FP4",
                                          "VLLM_FLASHINFER_MOE_BACKEND")}, settings)
        return
    from vllm import LLM, SamplingParams

    llm = LLM(**settings)
    prompt = "Natalia sold clips to 48 of her friends in April, and then she sold half as many " \
             "clips in May. How many clips did Natalia sell altogether in April and May?"
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=256))
    print(out[0].outputs[0].text)


if __name__ == "__main__":
    main()
