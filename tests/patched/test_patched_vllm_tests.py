# SPDX-License-Identifier: Apache-2.0
"""The tests each patch adds to vLLM (upstream/*.patch, vLLM's tests/ layout) pass in the patched
world and fail on stock 0.34.0: run as vLLM's CI would run them, with pytest in the directory
scripts/bootstrap-patched.sh wrote them to (upstream/conftest.py beside them)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.patched.conftest import REPAIR_OPT_IN

pytestmark = pytest.mark.multiproc

TESTS = Path(sys.prefix) / "vllm-tests"
# Per patch: the finding it turns true, its test file, and a test of it that stock must fail by
# assertion (not only by lacking the new function): DP+EP ranks collapse to different GEMM1
# scales; the conversion lets NaN through (0002: refused; 0005: repaired); a non-local route adds
# the workspace's leftovers; GEMM2's scales do not carry the up half's.
CASES = {"0001": ("upstream_agrees_gemm1_scale",
                  "tests/quantization/test_compressed_tensors_nvfp4_moe_ep_input_scales.py",
                  "test_dp_ep_ranks_quantize_with_one_gemm1_scale"),
         "0002": ("upstream_repairs_uncalibrated",
                  "tests/quantization/test_nvfp4_moe_uncalibrated_input_scales.py",
                  "test_kernel_format_conversion_refuses_an_uncalibrated_scale"),
         "0003": ("upstream_zeroes_non_local_routes",
                  "tests/kernels/moe/test_cutlass_moe_fp4_expert_map.py",
                  "test_non_local_routes_add_nothing"),
         "0004": ("upstream_carries_gate_up",
                  "tests/quantization/test_nvfp4_moe_gate_up_global_scales.py",
                  "test_quant_methods_hand_the_kernels_folded_scales"),
         "0005": ("upstream_repairs_uncalibrated",
                  "tests/quantization/test_nvfp4_moe_repair_input_scales.py",
                  "test_kernel_format_gets_repaired_scales")}


def _pytest(python: str, path: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != REPAIR_OPT_IN}  # as vLLM's CI runs
    return subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", path],
                          capture_output=True, text=True, cwd=TESTS, timeout=600, env=env)


@pytest.mark.parametrize("patch", list(CASES))
def test_patch_tests_pass_here_and_fail_on_stock(patch, fixed, stock_python):
    finding, path, must_fail = CASES[patch]
    if finding not in fixed:
        pytest.skip(f"this world lacks upstream/{patch}")
    assert (TESTS / path).exists(), f"{TESTS / path}: rerun scripts/bootstrap-patched.sh"
    here = _pytest(sys.executable, path)
    assert here.returncode == 0, here.stdout[-3000:]
    stock = _pytest(stock_python, path)
    assert stock.returncode == 1, stock.stdout[-3000:]
    failed = set(re.findall(r"^FAILED \S+::(\w+)", stock.stdout, re.M))
    assert must_fail in failed, stock.stdout[-3000:]
    # by assertion (an expected refusal that stock does not raise counts)
    assert "AssertionError" in stock.stdout or "DID NOT RAISE" in stock.stdout, stock.stdout[-3000:]
