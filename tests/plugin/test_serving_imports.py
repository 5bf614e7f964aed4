# SPDX-License-Identifier: Apache-2.0
"""A vLLM process with the plugin on imports only serving modules, and nothing of the lab.

In a fresh interpreter (the test's own, with the installed vLLM): VLLM_FP4_MOE_PLUGIN=1, vLLM's
own plugin loader calls register(), then vLLM's NVFP4 MoE modules are imported so the design's
patches install (tests/probes/serving_process_modules.py). The ``vllm_fp4_moe_plugin*`` and
``fp4_moe_lab*`` entries of sys.modules must then be serving modules (tests/serving_modules.py,
the wheel's allow-list) and none of the lab: the wheel users install has no lab.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.serving_modules import LAB_PACKAGE, PACKAGE, SERVING_MODULES

PROBE = Path(__file__).resolve().parents[1] / "probes" / "serving_process_modules.py"

def test_serving_process_imports_only_serving_modules(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_FP4_MOE_PLUGIN="1", VLLM_PLUGINS="fp4_moe")
    r = subprocess.run([sys.executable, str(PROBE)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    found = json.loads(next(ln for ln in r.stdout.splitlines()
                            if ln.startswith("MODULES "))[len("MODULES "):])
    assert found["state"][0] == "active", found["state"]
    modules = found["modules"]
    assert PACKAGE in modules and f"{PACKAGE}.patches" in modules, modules
    assert [m for m in modules if m.split(".")[0] == LAB_PACKAGE] == []
    assert sorted(set(modules) - SERVING_MODULES) == []
