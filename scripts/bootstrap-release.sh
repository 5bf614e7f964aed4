#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create the virtualenv of one focused test world, .venv-vllm-$WORLD, from
# constraints/vllm-$WORLD.txt, plus this plugin (--no-deps: its runtime needs nothing that vLLM
# does not bring). Usage: bootstrap-release.sh [WORLD]   (WORLD: 0.12.0, the default, or 0.34.0)
#   0.12.0  stock vLLM 0.12.0 (CUDA wheel, run on the CPU like .venv) with its torch 2.9.0 and
#           FlashInfer 0.5.3; used by tests/modular_method.
#   0.34.0  vLLM 0.34.0 installed --no-deps with torch 2.14.0 and only the pure-Python packages
#           its MoE/quantization/distributed code imports (the constraints file says why),
#           plus FlashInfer 0.7.x wheels kept beside it, not installed; used by tests/nvfp4_oracle.
# Re-running is cheap: it reinstalls only when the pins or the package metadata changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/disk.sh
. scripts/stamp.sh
PYTHON=${PYTHON:-python3}
WORLD=${1:-0.12.0}
VENV=.venv-vllm-$WORLD
PINS=constraints/vllm-$WORLD.txt
case "$WORLD" in
  0.12.0) need=15; what="~10 GiB before it is linked to .venv's copies, plus ~5 GiB of wheels";;
  0.34.0) need=14; what="~9 GiB before it is linked, plus ~5 GiB of wheels";;
  *) echo "[bootstrap-release] unknown world '$WORLD' (0.12.0 or 0.34.0)" >&2; exit 2;;
esac
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
stamp=$VENV/.installed
if stamp_stale $stamp $PINS setup.cfg pyproject.toml lab/pyproject.toml scripts/bootstrap-release.sh
then
  require_free_gib $need "installing $VENV ($what while pip runs)"
  echo "[bootstrap-release] installing the vLLM $WORLD world into $VENV (first time: ~5 min)"
  $VENV/bin/python -m pip install -q --upgrade pip
  if [ "$WORLD" = 0.12.0 ]; then
    $VENV/bin/python -m pip install -q -c $PINS vllm torch flashinfer-python compressed-tensors \
      transformers pytest safetensors
  else
    # Every pinned name except vLLM itself, with dependency resolution held to the pins...
    grep -E '^[A-Za-z]' $PINS | grep -v '^vllm==' | $VENV/bin/python -m pip install -q \
      -c $PINS -r /dev/stdin
    # ...then vLLM without its requirements (flashinfer-python==0.7.3 is not on the index).
    $VENV/bin/python -m pip install -q --no-deps -c $PINS vllm
    # FlashInfer 0.7.x wheels, downloaded, NOT installed (that would switch the TRT-LLM seam
    # off): tests/nvfp4_oracle/test_trtllm_layout.py runs their weight-shuffle helpers from
    # the zip. 0.7.2.post1 and 0.7.4 bracket vLLM's pin 0.7.3 (~62 + ~101 MB).
    for v in 0.7.2.post1 0.7.4; do
      $VENV/bin/python -m pip download -q --no-deps -d $VENV/flashinfer-wheels \
        "flashinfer-python==$v"
    done
  fi
  $VENV/bin/python -m pip install -q --no-deps -e . -e ./lab
  dedupe_venvs
  stamp_write $stamp
fi
