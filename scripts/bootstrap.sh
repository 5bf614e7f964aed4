#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create .venv in the repository root and install the pinned world (constraints/default.txt) plus this
# package (editable, with its console script). Re-running is cheap: it reinstalls only when
# constraints/default.txt, setup.cfg or pyproject.toml changed.
#   --with-engine   also build .venv-engine (vLLM 0.11.0's CPU build) for the engine tests
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/disk.sh
. scripts/stamp.sh
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[bootstrap] creating .venv with $($PYTHON --version)"
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.vllm-fp4-moe-plugin-installed
if stamp_stale $stamp constraints/default.txt setup.cfg pyproject.toml lab/pyproject.toml; then
  require_free_gib 16 "installing .venv (~11 GiB, plus ~5 GiB of wheels while pip runs)"
  echo "[bootstrap] installing vLLM 0.11.0, torch 2.8.0, FlashInfer 0.3.1 and this plugin" \
       "(first time: ~5-10 min, ~11 GB)"
  .venv/bin/python -m pip install -q --upgrade pip
  # vLLM and torch by name: the plugin requires nothing (setup.cfg says why), so its own
  # install would not bring them.
  .venv/bin/python -m pip install -q -c constraints/default.txt vllm torch -e ".[test]" -e ./lab
  dedupe_venvs
  stamp_write $stamp
fi
if [ "${1:-}" = "--with-engine" ]; then
  ./scripts/bootstrap-engine.sh
fi
