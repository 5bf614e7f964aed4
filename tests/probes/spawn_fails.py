# SPDX-License-Identifier: Apache-2.0
"""Ranks whose job fails after vLLM's groups are up: spawn() raises the rank's error and leaves
no log folder or shared memory behind. Prints ``FAILED AS INJECTED``. Run (with the checkout on
PYTHONPATH) by tests/tools/test_cli_errors.py."""

from fp4_moe_lab.simulation.layouts import LAYOUTS, spawn


def main() -> None:
    try:
        spawn(LAYOUTS["tp"], "tests.tools.test_cli_errors:failing_job")
    except RuntimeError as exc:
        assert "injected failure" in str(exc), exc
        print("FAILED AS INJECTED")


if __name__ == "__main__":  # the ranks are spawned: they import this file again as __mp_main__
    main()
