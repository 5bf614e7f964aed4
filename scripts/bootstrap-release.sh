#!/usr/bin/env bash
# Create .venv-vllm-0.12.0: stock vLLM 0.12.0 (CUDA wheel, run on the CPU like .venv) with its
# torch 2.9.0 and FlashInfer 0.5.3, plus this plugin (--no-deps: its runtime needs nothing
# that vLLM does not bring). Used by the focused suite tests/upstream (scripts/test.sh).
# Re-running is cheap: it reinstalls only when the pins or the package metadata changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/disk.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-vllm-0.12.0
PINS=constraints-vllm-0.12.0.txt
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
stamp=$VENV/.installed
want=$(cat $PINS setup.cfg pyproject.toml scripts/bootstrap-release.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  require_free_gib 15 "installing $VENV (~10 GiB before it is linked to .venv's copies, plus ~5 GiB of wheels while pip runs)"
  echo "[bootstrap-release] installing vLLM 0.12.0, torch 2.9.0, FlashInfer 0.5.3 into $VENV" \
       "(first time: ~5 min, ~10 GB)"
  $VENV/bin/python -m pip install -q --upgrade pip
  $VENV/bin/python -m pip install -q -c $PINS vllm torch flashinfer-python compressed-tensors \
    transformers pytest safetensors
  $VENV/bin/python -m pip install -q --no-deps -e .
  dedupe_venvs
  echo "$want" > "$stamp"
fi
