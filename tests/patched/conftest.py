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
# upstream/0005's opt-in: vLLM repairs uncalibrated expert scales where 0002 alone refuses them
# (tests that need the refusal turn it off; vLLM-style tests run without it, as vLLM's CI would)
REPAIR_OPT_IN = "VLLM_NVFP4_MOE_REPAIR_INPUT_SCALES"
if APPLIED:
    os.environ[REPAIR_OPT_IN] = "1"
collect_ignore_glob = collect_ignore_for("nvfp4_oracle") if APPLIED else ["test_*.py"]

# Each patch set, and the findings that must then see upstream's fix
# (patches/nvfp4_oracle/probe.py: probe_upstream_fixes).
_SCALES = {"upstream_agrees_gemm1_scale", "upstream_repairs_uncalibrated"}
_ROUTES = "upstream_zeroes_non_local_routes"
_CARRY = "upstream_carries_gate_up"
# "uncalibrated" is 0002 with 0005; its refusal (0005 off) is tested on its own.
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


@pytest.fixture
def refusing(monkeypatch):
    """This world with 0005's opt-in off: vLLM refuses uncalibrated expert scales (0002); the
    probes' cached answers forgotten before and after."""
    from vllm_fp4_moe_plugin.patches.nvfp4_oracle import probe

    monkeypatch.setenv(REPAIR_OPT_IN, "0")
    probe._reset_for_tests()
    yield
    probe._reset_for_tests()
