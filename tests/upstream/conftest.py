"""The focused suite for a vLLM release in the 0.11.1-era MoE design (0.11.1 to 0.13.0).

CI runs it in ``.venv-vllm-0.12.0`` (``scripts/test.sh``) with ``VLLM_FP4_MOE_EXPECT_DESIGN``
set, so a wrong virtualenv fails instead of collecting nothing. In the default suite (vLLM
0.11.0) these files are not collected: they would test the other release's code.
"""

import os

import pytest

from vllm_fp4_moe_plugin import compat

_design = compat.probe().design
_expected = os.environ.get("VLLM_FP4_MOE_EXPECT_DESIGN")
if _expected and _design != _expected:
    pytest.exit(f"VLLM_FP4_MOE_EXPECT_DESIGN={_expected} but the installed vLLM probes as "
                f"design {_design!r}; wrong virtualenv?", returncode=3)
collect_ignore_glob = [] if _design == compat.DESIGN_0_11_1 else ["test_*.py"]
