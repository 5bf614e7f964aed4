#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# gsm8k (5-shot) on a 4-GPU Blackwell (SM100) host with the newest vLLM: stock vs the plugin for
# a public compressed-tensors NVFP4 MoE checkpoint. This is the run that confirms what the CPU
# matrix on vLLM 0.34.0 claims (README, "What is verified"):
#
#   LAYOUT=dp4_ep ./examples/eval_gsm8k_newest.sh   # DP=4 + EP, default dispatch: the hole
#   LAYOUT=tp4_ep ./examples/eval_gsm8k_newest.sh   # TP=4 + EP: the control (no hole)
#   DRY_RUN=1 LAYOUT=... ./examples/eval_gsm8k_newest.sh   # print the commands, start nothing
#   MOE_BACKEND=cutlass LAYOUT=tp4_ep ./examples/eval_gsm8k_newest.sh   # vLLM's own CUTLASS
#     kernel (--moe-backend cutlass): under EP, in both layouts, routes to other ranks' experts
#     read an unzeroed workspace row on stock 0.32.0-0.34.0 (docs/SUPPORT.md, GPU families)
#
# Needs: 4 x B200/GB200, `pip install "vllm==0.34.0" "lm-eval[api]"` (vLLM's own pins) and
# this package (`pip install -e .`). Both runs use vLLM's defaults on SM100 (FlashInfer TRT-LLM
# NVFP4 MoE, --all2all-backend allgather_reducescatter). Writes results/gsm8k_newest_<layout>.md
# (<layout>_<backend> with MOE_BACKEND).
# First, how far stock is off per layer for this checkpoint at EP 4 (reads scales only):
#   vllm-fp4-moe audit /path/to/the/downloaded/checkpoint --vllm 0.34.0 --ep-size 4
set -euo pipefail
MODEL=${MODEL:-RedHatAI/Qwen3-30B-A3B-NVFP4}
LAYOUT=${LAYOUT:-dp4_ep}
LIMIT=${LIMIT:-}          # e.g. LIMIT=250 for a quick look; empty = full test set (1319)
PORT=${PORT:-8012}
OUT=${OUT:-results}
case "$LAYOUT" in
  dp4_ep) layout_args=(--data-parallel-size 4 --enable-expert-parallel) ;;
  tp4_ep) layout_args=(--tensor-parallel-size 4 --enable-expert-parallel) ;;
  *) echo "LAYOUT must be dp4_ep or tp4_ep (got '$LAYOUT')" >&2; exit 2 ;;
esac
limit_arg=${LIMIT:+--limit $LIMIT}
serve=(vllm serve "$MODEL" "${layout_args[@]}" --max-model-len 4096 --port "$PORT")
if [ -n "${MOE_BACKEND:-}" ]; then serve+=(--moe-backend "$MOE_BACKEND"); fi
TAG=$LAYOUT${MOE_BACKEND:+_$MOE_BACKEND}  # the results files' name
evaluate=(lm_eval --model local-completions
  --model_args "model=$MODEL,base_url=http://localhost:$PORT/v1/completions,num_concurrent=64,tokenized_requests=False"
  --tasks gsm8k --num_fewshot 5)
if [ -n "${DRY_RUN:-}" ]; then
  for switch in 0 1; do
    printf '%q ' env "VLLM_FP4_MOE_PLUGIN=$switch" "${serve[@]}"; echo
    printf '%q ' "${evaluate[@]}" $limit_arg --output_path "$OUT/gsm8k_newest_${TAG}_plugin$switch"
    echo
  done
  exit 0
fi
mkdir -p "$OUT"

run() {  # $1 = plugin switch (0: stock vLLM, 1: the plugin)
  VLLM_FP4_MOE_PLUGIN=$1 "${serve[@]}" > "$OUT/serve_newest_${TAG}_plugin$1.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' RETURN
  until curl -sf "localhost:$PORT/health" > /dev/null; do
    kill -0 $pid 2>/dev/null || {
      echo "vllm serve died; see $OUT/serve_newest_${TAG}_plugin$1.log" >&2; return 1; }
    sleep 10
  done
  "${evaluate[@]}" $limit_arg --output_path "$OUT/gsm8k_newest_${TAG}_plugin$1"
}

run 0 | tee "$OUT/gsm8k_newest_${TAG}_stock.txt"
run 1 | tee "$OUT/gsm8k_newest_${TAG}_plugin.txt"
{
  echo "| $MODEL, $LAYOUT, vLLM $(python -c 'import vllm; print(vllm.__version__)') | gsm8k 5-shot |"
  echo "|---|---|"
  echo "| stock vLLM | $(grep -m1 'gsm8k' "$OUT/gsm8k_newest_${TAG}_stock.txt" || echo '?') |"
  echo "| with vllm-fp4-moe-plugin | $(grep -m1 'gsm8k' "$OUT/gsm8k_newest_${TAG}_plugin.txt" || echo '?') |"
  echo
  echo "Plugin log lines (what it changed):"
  grep -h "vllm-fp4-moe-plugin" "$OUT/serve_newest_${TAG}_plugin1.log" | sort -u | head -5
} > "$OUT/gsm8k_newest_${TAG}.md"
cat "$OUT/gsm8k_newest_${TAG}.md"
