#!/usr/bin/env bash
# The whole test run (what CI runs, and the README's test command): set up the three
# virtualenvs, then the default suite on vLLM 0.11.0 and the focused suite on vLLM 0.12.0.
# Extra arguments go to the default suite's pytest (e.g. -x, -k expr).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh --with-engine
./scripts/bootstrap-release.sh
status=0
.venv/bin/python -m pytest "$@" || status=$?
# The focused suite refuses to run (exit 3) in a virtualenv of another MoE design.
VLLM_FP4_MOE_EXPECT_DESIGN=0.11.1 .venv-vllm-0.12.0/bin/python -m pytest tests/upstream \
  -p no:cacheprovider || status=$?
exit $status
