#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create .venv-quant, the dev-only world that writes the NVFP4 test checkpoints of accuracy/
# (accuracy/quantize.py, accuracy/modelopt_export.py) with the quantizers people use:
# llmcompressor 0.14.0.1 and nvidia-modelopt 0.47.0, on the CPU. Pins: constraints/quant.txt.
# Not needed by the plugin, its tests or CI. Re-running is cheap (stamp file).
# Everything comes from the package index alone: machine-local find-links and extra indexes of
# this workplace's pip configuration are switched off for this install.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/disk.sh
. scripts/stamp.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-quant
PINS=constraints/quant.txt
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
stamp=$VENV/.installed
if stamp_stale $stamp $PINS scripts/bootstrap-quant.sh; then
  require_free_gib 12 "installing $VENV (~7 GiB, plus wheels while pip runs)"
  echo "[bootstrap-quant] installing llmcompressor, nvidia-modelopt, torch (CPU use) into $VENV"
  export PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= PIP_EXTRA_INDEX_URL=
  $VENV/bin/python -m pip install -q --upgrade pip
  grep -E '^[A-Za-z]' $PINS | $VENV/bin/python -m pip install -q -c $PINS -r /dev/stdin
  stamp_write $stamp
fi
