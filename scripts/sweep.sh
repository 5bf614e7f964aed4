#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The release sweep (lab/fp4_moe_lab/sweep.py): each vLLM release from 0.11.0 on, in a throwaway
# world under .sweep/, probed and measured (layer matrix, uncalibrated rows); one row each in
# docs/data/releases.json. Resumable: releases already there are skipped (--force re-measures).
#   ./scripts/sweep.sh                      every release on the index (hours; ~16 GiB free each)
#   ./scripts/sweep.sh --release 0.14.0     one release (repeatable)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=lab exec "${PYTHON:-python3}" -m fp4_moe_lab.sweep "$@"
