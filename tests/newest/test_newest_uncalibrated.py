"""Uncalibrated experts on real vLLM layers of the nvfp4_oracle design, vLLM 0.34.0 (issue 19)."""

import pytest

from tests import uncalibrated_checks as checks
from vllm_fp4_moe_plugin.support import Design

pytestmark = [pytest.mark.cpu, pytest.mark.multiproc, pytest.mark.slow]
# DP=2+EP (where the EP agreement could spread the value) runs on the newest design; the
# published docs/uncalibrated-vllm-*.json hold it for every release.
LAYOUTS = checks.LAYOUTS


@pytest.fixture(scope="module")
def rows():
    from vllm_fp4_moe_plugin.simulation.uncalibrated import run_uncalibrated

    return {(r["format"], r["layout"], r["gemm"], r["case"]): r
            for r in run_uncalibrated(LAYOUTS, checks.CI_PLANTS)}


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("plant", checks.CI_PLANTS)
def test_uncalibrated_expert(rows, fmt, layout, plant):
    checks.check_row(rows[(fmt, layout, *plant)], Design.NVFP4_ORACLE)
