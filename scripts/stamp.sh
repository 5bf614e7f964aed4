# SPDX-License-Identifier: Apache-2.0
# Sourced by the scripts that build virtualenvs: a virtualenv is (re)installed only when the
# files that decide what it holds (pins, package metadata, the recipe itself) have changed
# since its last successful install, so re-running a bootstrap costs seconds.

# stamp_stale STAMP_FILE FILE...: true (0) when STAMP_FILE does not hold the hash of FILEs;
# the hash is left in STAMP_WANT for stamp_write.
stamp_stale() {
  local stamp=$1
  shift
  STAMP_WANT=$(cat "$@" | sha256sum | cut -d' ' -f1)
  [ "$(cat "$stamp" 2>/dev/null || true)" != "$STAMP_WANT" ]
}

# stamp_write STAMP_FILE: record the hash of the last stamp_stale, after the install succeeded.
stamp_write() {
  echo "$STAMP_WANT" > "$1"
}
