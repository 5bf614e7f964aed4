# SPDX-License-Identifier: Apache-2.0
"""What ``register()`` imports: vLLM calls it in every process it starts, the switch on or off,
so it must stay cheap. The entry point and three vLLM-free modules (the base layer's folder, the
switch's variables, the names of vLLM's modules with the import hook); the probe, the patches,
the fleet check and the off warning come in when vLLM imports what they wait for
(tests/plugin/test_off_path_imports.py measures those steps with vLLM). Measured with
``-X importtime`` in a fresh interpreter (no vLLM installed here: nothing fires)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = "vllm_fp4_moe_plugin"
BUDGET = {PKG, f"{PKG}.base", f"{PKG}.base.envs", f"{PKG}.base.vllm_modules"}


def _imported_by_register(switch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_FP4_MOE")}
    if switch is not None:
        env["VLLM_FP4_MOE_PLUGIN"] = switch
    r = subprocess.run([sys.executable, "-X", "importtime", "-c",
                        f"import {PKG}; {PKG}.register()"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # importtime's lines: "import time: self | cumulative | name" (name indented by depth)
    names = {m.group(1) for m in re.finditer(r"\|\s+(\S+)\s*$", r.stderr, re.M)}
    return {n for n in names if n == PKG or n.startswith(PKG + ".")}


@pytest.mark.parametrize("switch", [None, "0", "1"])
def test_register_imports_the_entry_point_and_three_modules(switch):
    imported = _imported_by_register(switch)
    assert imported == BUDGET, sorted(imported ^ BUDGET)
