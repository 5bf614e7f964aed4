# SPDX-License-Identifier: Apache-2.0
"""The suite of the patched world: vLLM 0.34.0 with upstream/'s patches applied to its installed
``vllm/`` (scripts/bootstrap-patched.sh). It runs only when ``VLLM_FP4_MOE_PATCHED`` names the
applied set (``ep-scale``, ``uncalibrated``, ``routes``, ``gate-up``, ``both`` or ``all``) and
``VLLM_FP4_MOE_EXPECT_DESIGN`` is ``nvfp4_oracle`` (scripts/test.sh sets both); elsewhere nothing
here is collected.
"""

import os
import re
import sys
from pathlib import Path

import pytest

from tests.design_gate import collect_ignore_for

APPLIED = os.environ.get("VLLM_FP4_MOE_PATCHED", "")
collect_ignore_glob = collect_ignore_for("nvfp4_oracle") if APPLIED else ["test_*.py"]

# Each patch set, and the findings that must then see upstream's fix
# (patches/nvfp4_oracle/probe.py: probe_upstream_fixes).
_SCALES = {"upstream_agrees_gemm1_scale", "upstream_repairs_uncalibrated"}
_ROUTES = "upstream_zeroes_non_local_routes"
_CARRY = "upstream_carries_gate_up"
FIXES = {"ep-scale": {"upstream_agrees_gemm1_scale"},
         "uncalibrated": {"upstream_repairs_uncalibrated"},
         "routes": {_ROUTES}, "gate-up": {_CARRY}, "both": _SCALES,
         "all": _SCALES | {_ROUTES, _CARRY}}


@pytest.fixture(scope="session")
def fixed() -> set:
    """The findings upstream's fixes must turn true in this world."""
    if APPLIED not in FIXES:
        pytest.exit(f"VLLM_FP4_MOE_PATCHED={APPLIED!r}: one of {', '.join(FIXES)}",
                    returncode=pytest.ExitCode.USAGE_ERROR)
    return FIXES[APPLIED]


@pytest.fixture(scope="session")
def stock_python() -> str:
    """The interpreter of the stock 0.34.0 world this one was copied from (what the patched
    answers are compared with): ``.venv-vllm-0.34.0`` beside this virtualenv."""
    base = re.sub(r"-patched-[a-z-]+$", "", sys.prefix)
    python = Path(base) / "bin" / "python"
    assert base != sys.prefix and python.exists(), (
        f"the stock world {base} of this patched world {sys.prefix} is gone; run "
        "scripts/bootstrap-release.sh 0.34.0")
    return str(python)
