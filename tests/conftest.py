# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures: log capture through vLLM's non-propagating logger, a fresh plugin state."""

import logging
import os
import sys
from pathlib import Path

import pytest

# The tiers are folders (scripts/test.sh): tests/ut (no vLLM, no torch), the vLLM-layer tier (the
# other folders, in the default world; tests/modular_method, tests/nvfp4_oracle and tests/patched
# in their release worlds), tests/engine (real vLLM CPU engines), tests/accuracy (lm-eval cells).
_UNIT_DIR = Path(__file__).resolve().parent / "ut"


def pytest_sessionfinish(session, exitstatus):
    """A unit-tier run (tests/ut only) that imported vLLM or torch broke the tier's contract:
    the tier must run where neither is installed (.venv-unit), so fail it here too."""
    paths = [Path(str(item.fspath)).resolve() for item in getattr(session, "items", [])]
    if exitstatus != 0 or not paths or not all(p.is_relative_to(_UNIT_DIR) for p in paths):
        return
    heavy = sorted(m for m in ("vllm", "torch") if m in sys.modules)
    if heavy:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nunit tier imported {', '.join(heavy)}: a unit test must need neither "
              "(move it to the vLLM-layer tier)", file=sys.stderr)

# Keep CPU tests deterministic and quiet; spawned workers inherit these.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


@pytest.fixture
def caplog_plugin(caplog):
    """caplog that sees ``vllm.*`` records: vLLM sets propagate=False on its logger."""
    import vllm.logger  # noqa: F401  (configures the "vllm" logger)

    vllm_logger = logging.getLogger("vllm")
    old = vllm_logger.propagate
    vllm_logger.propagate = True
    caplog.set_level(logging.DEBUG, logger="vllm.fp4_moe_plugin")
    try:
        yield caplog
    finally:
        vllm_logger.propagate = old


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin module with no decision made and no patch applied, before and after."""
    import vllm_fp4_moe_plugin as plugin

    monkeypatch.delenv("VLLM_FP4_MOE_PLUGIN", raising=False)
    # register() marks the process that launches a deployment; "0" here is restored to unset
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_LAUNCHER", "0")
    plugin._reset_for_tests()
    yield plugin
    plugin._reset_for_tests()


def plugin_records(caplog, level=logging.INFO):
    return [r for r in caplog.records
            if r.name.startswith("vllm.fp4_moe_plugin") and r.levelno >= level]


@pytest.fixture
def blackwell_env(monkeypatch):
    """doctor tests: none of the variables doctor reads, except the FlashInfer MoE switch."""
    from vllm_fp4_moe_plugin.tools import doctor

    for k in doctor.VLLM_ENV + doctor.OWN_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_MOE_FP4", "1")
    return monkeypatch


@pytest.fixture(scope="module")
def spread_checkpoints(tmp_path_factory):
    """``{format: directory}``: tiny Qwen3-MoE NVFP4 checkpoints whose experts' input scales
    spread 4x (their EP halves' maxima differ too), one per format, for the doctor suites."""
    from fp4_moe_lab.checkpoint.writer import write_checkpoint

    out = {}
    for fmt in ("modelopt", "compressed-tensors"):
        path = tmp_path_factory.mktemp(fmt)
        write_checkpoint(path, fmt=fmt, arch="qwen3_moe", input_scale_spread=4.0)
        out[fmt] = path
    return out
