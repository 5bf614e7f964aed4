# SPDX-License-Identifier: Apache-2.0
# Sourced by the bootstrap scripts: fail before pip starts, not halfway through an install,
# when the disk cannot hold the virtualenv about to be built, and keep pip's temporary files
# (downloaded wheels, several GB while one `pip install` runs) on the same disk as the
# virtualenvs, so one free-space number tells whether an install fits.

# require_free_gib GIB WHAT: exit 1 with a message naming what to free if the checkout's
# filesystem has less than GIB GiB free.
require_free_gib() {
  local need=$1 what=$2 avail
  avail=$(df -P -BG . | awk 'NR==2 {sub("G", "", $4); print $4}')
  if [ "${avail:-0}" -lt "$need" ]; then
    echo "[disk] $what needs ~${need} GiB free on $(df -P . | awk 'NR==2 {print $6}')," \
         "only ${avail} GiB are: free space there (rm -rf .venv-* removes this checkout's" \
         "other test virtualenvs) and re-run" >&2
    exit 1
  fi
  echo "[disk] ${avail} GiB free, $what needs ~${need} GiB"
}

TMPDIR=$(mktemp -d "$PWD/.pip-tmp.XXXXXX")
export TMPDIR
trap 'rm -rf "$TMPDIR"' EXIT

# dedupe_venvs: hard-link the files the test virtualenvs share (scripts/dedupe_venvs.py).
dedupe_venvs() {
  [ -d .venv ] || return 0  # nothing to link to (an engine world built before .venv)
  "${PYTHON:-python3}" scripts/dedupe_venvs.py .venv .venv-engine .venv-engine-0.32.0 .venv-vllm-0.12.0 .venv-vllm-0.34.0
}
