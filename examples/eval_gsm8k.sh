#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# gsm8k (5-shot) on a Blackwell (SM100) host: stock vLLM 0.11.0 vs the plugin, same settings.
# This is the run that confirms what the CPU simulation claims (README, "What is verified").
#
#   LAYOUT=tp4_ep ./examples/eval_gsm8k.sh     # TP=4 + EP, offline vLLM backend (PR #27223's case)
#   LAYOUT=dp4_ep ./examples/eval_gsm8k.sh     # DP=4 + EP, through `vllm serve`
#
# Needs: 4 x B200/GB200, `pip install -c constraints/default.txt "vllm[flashinfer]" lm-eval[api]` and
# this package. Writes results/gsm8k_<layout>.md.
set -euo pipefail
MODEL=${MODEL:-nvidia/DeepSeek-R1-0528-FP4-v2}
LAYOUT=${LAYOUT:-tp4_ep}
LIMIT=${LIMIT:-}          # e.g. LIMIT=200 for a quick look; empty = full test set
PORT=${PORT:-8011}
OUT=${OUT:-results}
mkdir -p "$OUT"
export VLLM_USE_FLASHINFER_MOE_FP4=1 VLLM_FLASHINFER_MOE_BACKEND=throughput
limit_arg=${LIMIT:+--limit $LIMIT}

run_offline() {  # $1 = plugin switch
  VLLM_FP4_MOE_PLUGIN=$1 lm_eval --model vllm \
    --model_args "pretrained=$MODEL,tensor_parallel_size=4,enable_expert_parallel=True,max_model_len=4096,gpu_memory_utilization=0.85" \
    --tasks gsm8k --num_fewshot 5 --batch_size auto $limit_arg \
    --output_path "$OUT/gsm8k_${LAYOUT}_plugin$1"
}

run_served() {  # $1 = plugin switch
  VLLM_FP4_MOE_PLUGIN=$1 vllm serve "$MODEL" --data-parallel-size 4 --enable-expert-parallel \
    --max-model-len 4096 --port "$PORT" > "$OUT/serve_plugin$1.log" 2>&1 &
  local pid=$!
  trap 'kill $pid 2>/dev/null || true' RETURN
  until curl -sf "localhost:$PORT/health" > /dev/null; do
    kill -0 $pid 2>/dev/null || { echo "vllm serve died; see $OUT/serve_plugin$1.log"; return 1; }
    sleep 10
  done
  lm_eval --model local-completions \
    --model_args "model=$MODEL,base_url=http://localhost:$PORT/v1/completions,num_concurrent=64,tokenized_requests=False" \
    --tasks gsm8k --num_fewshot 5 $limit_arg --output_path "$OUT/gsm8k_${LAYOUT}_plugin$1"
}

case "$LAYOUT" in
  tp4_ep) runner=run_offline ;;
  dp4_ep) runner=run_served ;;
  *) echo "LAYOUT must be tp4_ep or dp4_ep (got '$LAYOUT')" >&2; exit 2 ;;
esac
$runner 0 | tee "$OUT/gsm8k_${LAYOUT}_stock.txt"
$runner 1 | tee "$OUT/gsm8k_${LAYOUT}_plugin.txt"
{
  echo "| $MODEL, $LAYOUT | gsm8k 5-shot (flexible-extract / strict-match) |"
  echo "|---|---|"
  echo "| stock vLLM 0.11.0 | $(grep -m1 'gsm8k' "$OUT/gsm8k_${LAYOUT}_stock.txt" || echo '?') |"
  echo "| with vllm-fp4-moe-plugin | $(grep -m1 'gsm8k' "$OUT/gsm8k_${LAYOUT}_plugin.txt" || echo '?') |"
} > "$OUT/gsm8k_${LAYOUT}.md"
cat "$OUT/gsm8k_${LAYOUT}.md"
