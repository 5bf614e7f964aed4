# SPDX-License-Identifier: Apache-2.0
"""vLLM's own plugin loader installs the fix in a fresh worker-like process, before any
``process_weights_after_loading`` can run (vLLM 0.34.0 calls ``load_general_plugins()`` first
thing in ``WorkerWrapperBase.init_worker``, v0.34.0 v1/worker/worker_base.py:289-305, and in the
engine core)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.multiproc

ORACLE = "vllm.model_executor.layers.fused_moe.oracle.nvfp4"
CT_NVFP4 = ("vllm.model_executor.layers.quantization.compressed_tensors."
            "compressed_tensors_moe.compressed_tensors_moe_w4a4_nvfp4")
HELPER = "prepare_nvfp4_moe_layer_for_fi_or_cutlass"

PROBE = Path(__file__).resolve().parents[1] / "probes" / "plugin_loader_worker.py"

def _run(switch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    if switch is not None:
        env["VLLM_FP4_MOE_PLUGIN"] = switch
    r = subprocess.run([sys.executable, str(PROBE), CT_NVFP4, ORACLE, HELPER],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), out


def test_vllm_plugin_loader_installs_the_fix_before_weights_are_processed():
    result, out = _run("1")
    assert result == {"state": "active", "convert_is_oracles": True,
                      "helper_module":
                          "vllm_fp4_moe_plugin.patches.nvfp4_oracle.ep_agreed_gemm1_scale"}
    active = [x for x in out.splitlines() if "vllm-fp4-moe-plugin active: replaced" in x]
    assert len(active) == 1 and f"{ORACLE}.{HELPER}" in active[0], out[-3000:]


@pytest.mark.parametrize("switch", [None, "0"])
def test_switched_off_the_oracle_is_vllms_own(switch):
    result, _ = _run(switch)
    assert result["state"] == "inert" and result["convert_is_oracles"]
    assert result["helper_module"] == ("vllm.model_executor.layers.quantization.utils."
                                       "flashinfer_fp4_moe")
