# SPDX-License-Identifier: Apache-2.0
"""The gate of the focused suites (tests/modular_method, tests/nvfp4_oracle): each runs only in a
world of its own MoE design, asked for with ``VLLM_FP4_MOE_EXPECT_DESIGN``
(``scripts/test.sh``)."""

import os

import pytest


def collect_ignore_for(design: str) -> list[str]:
    """The suite's ``collect_ignore_glob``: nothing when ``VLLM_FP4_MOE_EXPECT_DESIGN`` names
    ``design`` (and the installed vLLM must then probe as it, else the run stops: pytest reports
    the conftest error, naming both designs, and exits 4; a wrong virtualenv is not a pass);
    every test file
    otherwise, so no other world imports the suite's release-specific code."""
    expected = os.environ.get("VLLM_FP4_MOE_EXPECT_DESIGN")
    if expected != design:
        return ["test_*.py"]
    from vllm_fp4_moe_plugin.patches import compat

    found = compat.probe().design
    if found != expected:
        pytest.exit(f"VLLM_FP4_MOE_EXPECT_DESIGN={expected} but the installed vLLM probes as "
                    f"design {found or 'unknown'}; wrong virtualenv?",
                    returncode=pytest.ExitCode.USAGE_ERROR)  # 4: what a conftest error gives
    return []


def one_module_targets(observation) -> set[str]:
    """The targets the one-module patches (``patches/*.py`` with ``PATCH``) add to the plan of
    ``observation``, from their own predicates: each such patch has its own test
    (tests/patches/), so a design's suite asserts its folder's entries exactly and these by
    derivation (a new one-module patch needs no edit here)."""
    from vllm_fp4_moe_plugin.patches.registry import DESIGNS

    part = DESIGNS[observation.design]
    return {e.target for p in part.extras for e in p.entries if e.needed(observation.findings)}
