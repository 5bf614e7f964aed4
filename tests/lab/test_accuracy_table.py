# SPDX-License-Identifier: Apache-2.0
"""The accuracy table's writer lock (fp4_moe_lab.accuracy.table), no engine: one writer per JSON."""

import os
import subprocess
import sys
from pathlib import Path

from fp4_moe_lab.accuracy import table as run_table

ROOT = Path(__file__).resolve().parents[2]


def test_second_writer_of_one_json_stops_naming_the_first(tmp_path):
    out = tmp_path / "table.json"
    held = run_table.hold_writer_lock(out)
    try:
        # a second run_table process on the same JSON: it must stop, not overwrite our cells
        r = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "probes" / "second_table_writer.py"), str(out)],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        assert f"another run is writing {out}" in r.stderr
        assert f"pid {os.getpid()}" in r.stderr
        # a different JSON (a trial table) is not blocked
        other = run_table.hold_writer_lock(tmp_path / "trial.json")
        other.close()
    finally:
        held.close()
    # released with its holder: the next run takes it
    run_table.hold_writer_lock(out).close()
