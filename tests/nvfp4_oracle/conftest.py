# SPDX-License-Identifier: Apache-2.0
"""The focused suite for a vLLM release in the NVFP4-oracle MoE design (0.14.0 to 0.34.0).

It runs only when asked: ``VLLM_FP4_MOE_EXPECT_DESIGN=nvfp4_oracle`` (``scripts/test.sh`` sets
it for ``.venv-vllm-0.34.0``). The installed vLLM must then probe as that design, or the run
stops (pytest exit 4, the error naming both designs) instead of testing the wrong release.
Without the variable, or with another design's, nothing here is collected, so neither the
default suite (vLLM 0.11.0) nor tests/modular_method (0.12.0) imports this release's MoE code.
"""

import pytest

from tests.design_gate import collect_ignore_for

collect_ignore_glob = collect_ignore_for("nvfp4_oracle")


@pytest.fixture(scope="session")
def matrix_rows():
    """``vllm-fp4-moe-lab matrix --json`` on the installed release, run once per session: every
    layout x format x backend (CUTLASS and TRT-LLM) is the slowest thing in this suite, so the
    command's own test and the per-backend row checks all read this one run."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "fp4_moe_lab.cli", "matrix", "--json"],
                       capture_output=True, text=True, timeout=2400)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)
