#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Serve nvidia/DeepSeek-R1-0528-FP4-v2 on a 4-GPU Blackwell (SM100) host with the plugin on.
#
#   LAYOUT=tp4_ep ./examples/serve_deepseek_r1_fp4.sh   # TP=4 + expert parallel
#   LAYOUT=dp4_ep ./examples/serve_deepseek_r1_fp4.sh   # DP=4 + expert parallel (all-gather)
#   LAYOUT=pp2    ./examples/serve_deepseek_r1_fp4.sh   # PP=2 x TP=2
#   DRY_RUN=1 ...                                      # print the command, start nothing
set -euo pipefail
MODEL=${MODEL:-nvidia/DeepSeek-R1-0528-FP4-v2}
LAYOUT=${LAYOUT:-tp4_ep}
PORT=${PORT:-8000}
case "$LAYOUT" in
  tp4_ep) layout_args=(--tensor-parallel-size 4 --enable-expert-parallel) ;;
  dp4_ep) layout_args=(--data-parallel-size 4 --enable-expert-parallel) ;;
  pp2)    layout_args=(--pipeline-parallel-size 2 --tensor-parallel-size 2) ;;
  *) echo "LAYOUT must be tp4_ep, dp4_ep or pp2 (got '$LAYOUT')" >&2; exit 2 ;;
esac
export VLLM_FP4_MOE_PLUGIN=1                 # the fix; every vLLM process loads it
export VLLM_USE_FLASHINFER_MOE_FP4=1          # FlashInfer NVFP4 MoE, as without the plugin
export VLLM_FLASHINFER_MOE_BACKEND=${VLLM_FLASHINFER_MOE_BACKEND:-throughput}
cmd=(vllm serve "$MODEL" "${layout_args[@]}" --max-model-len 8192 --port "$PORT")
if [ -n "${DRY_RUN:-}" ]; then
  printf '%q ' env VLLM_FP4_MOE_PLUGIN=1 VLLM_USE_FLASHINFER_MOE_FP4=1 \
    "VLLM_FLASHINFER_MOE_BACKEND=$VLLM_FLASHINFER_MOE_BACKEND" "${cmd[@]}"; echo
  exit 0
fi
exec "${cmd[@]}"
