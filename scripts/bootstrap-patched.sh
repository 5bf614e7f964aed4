#!/usr/bin/env bash
# The vLLM 0.34.0 world with this repository's upstream patches (upstream/*.patch) applied to its
# installed vllm/: .venv-vllm-0.34.0-patched-$WHICH, a hard-linked copy of .venv-vllm-0.34.0
# (built first; the copy costs seconds and almost no disk) whose patched files `git apply`
# writes anew, so the stock world's files stay as they are. The patches' vLLM-style tests go to
# $VENV/vllm-tests with upstream/conftest.py (what vLLM's own tests/conftest.py would give them).
# Usage: bootstrap-patched.sh [ep-scale|uncalibrated|both]   (default: both)
#   ep-scale      0001: the GEMM1 activation scale agreed over the EP group under DP+EP
#   uncalibrated  0002: uncalibrated and missing expert activation scales repaired at load
# Prints the virtualenv's path last. Re-running is cheap: it rebuilds only when a patch or the
# stock world changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/stamp.sh
WHICH=${1:-both}
case "$WHICH" in
  ep-scale) PATCHES=(upstream/0001-*.patch);;
  uncalibrated) PATCHES=(upstream/0002-*.patch);;
  both) PATCHES=(upstream/0001-*.patch upstream/0002-*.patch);;
  *) echo "[bootstrap-patched] unknown patch set '$WHICH' (ep-scale, uncalibrated or both)" >&2
     exit 2;;
esac
./scripts/bootstrap-release.sh 0.34.0 >&2
BASE=.venv-vllm-0.34.0
VENV=$BASE-patched-$WHICH
stamp=$VENV/.patched
if stamp_stale $stamp "${PATCHES[@]}" upstream/conftest.py $BASE/.installed \
     scripts/bootstrap-patched.sh; then
  rm -rf "$VENV"
  cp -al "$BASE" "$VENV"
  site=$(echo "$VENV"/lib/python3*/site-packages)
  mkdir -p "$VENV/vllm-tests"
  for p in "${PATCHES[@]}"; do
    echo "[bootstrap-patched] applying $p to $site/vllm" >&2
    git apply --directory="$site" --include="$site/vllm/*" --unsafe-paths "$p"
    git apply --directory="$VENV/vllm-tests" --include="$VENV/vllm-tests/tests/*" --unsafe-paths "$p"
  done
  cp upstream/conftest.py "$VENV/vllm-tests/conftest.py"
  stamp_write $stamp
fi
echo "$VENV"
