# SPDX-License-Identifier: Apache-2.0
"""With the switch off, the plugin loads three modules or fewer at each step of a vLLM process
and nothing of a design's folder: ``register()``, the fleet check's trigger installed when vLLM
imports its parallel state, and the trigger run when vLLM builds its world group.

Off must not slow vLLM: a rank that is off only takes part in the fleet check (so that a rank
running the fix knows it is not alone). Measured with ``-X importtime`` in a fresh interpreter
with the installed vLLM and a real world group (gloo, world size 1:
tests/probes/off_path_modules.py), each step's imports read between its markers and checked
against ``sys.modules``; the ``register()`` step alone is also measured without vLLM
(tests/ut/test_import_budget.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROBE = Path(__file__).resolve().parents[1] / "probes" / "off_path_modules.py"
PKG = "vllm_fp4_moe_plugin"
STEPS = ("register", "parallel_state", "rendezvous")
# What each step may load, in the order vLLM takes them (three each at most, none of a design).
EXPECTED = {
    "register": {PKG, f"{PKG}.base", f"{PKG}.base.envs", f"{PKG}.base.vllm_modules"},
    "parallel_state": {f"{PKG}.patches", f"{PKG}.patches.patching",
                       f"{PKG}.patches.fleet_rendezvous"},
    "rendezvous": {f"{PKG}.patches.fleet", f"{PKG}.base.log"},
}
DESIGN_FOLDERS = ("init_prepare_finalize", "modular_method", "nvfp4_oracle")


def _stages(switch):
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    env.update(VLLM_PLUGINS="fp4_moe", VLLM_HOST_IP="127.0.0.1")
    if switch is not None:
        env["VLLM_FP4_MOE_PLUGIN"] = switch
    r = subprocess.run([sys.executable, "-X", "importtime", str(PROBE)], capture_output=True,
                       text=True, timeout=300, env=env, cwd=PROBE.parent)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    found = json.loads(next(ln for ln in r.stdout.splitlines()
                            if ln.startswith("STAGES "))[len("STAGES "):])
    # importtime's lines: "import time: self | cumulative | name" (name indented by depth)
    imported, now = {}, set()
    for line in r.stderr.splitlines():
        m = re.search(r"^import time:.*\|\s+(\S+)\s*$", line)
        if m and (m[1] == PKG or m[1].startswith(PKG + ".")):
            now.add(m[1])
        elif line.startswith("STEP "):
            imported[line[5:]], now = now, set()
    found["importtime"] = {k: sorted(v) for k, v in imported.items()}
    return found


@pytest.mark.parametrize("switch", [None, "0"])
def test_off_loads_three_modules_a_step_and_no_design(switch):
    found = _stages(switch)
    assert found["state"][0] == "inert", found["state"]
    before: set[str] = set()
    for step in STEPS:
        now = set(found["stages"][step])
        added = now - before
        assert added == EXPECTED[step], (step, sorted(added ^ EXPECTED[step]))
        # importtime printed no line for the entry point here (sys.modules has it)
        assert set(found["importtime"][step]) == added - {PKG}, (step, found["importtime"])
        assert len(added - {PKG}) <= 3, (step, sorted(added))
        before = now
    assert not [m for m in before if any(f".patches.{d}" in m for d in DESIGN_FOLDERS)]


def test_on_loads_the_design_at_the_same_steps():
    """The measurement sees a heavier path: with the switch on, the probe runs once vLLM
    imports its NVFP4 MoE modules and the design's folder loads (what off must not do)."""
    found = _stages("1")
    loaded = set(found["stages"]["rendezvous"])
    assert f"{PKG}.patches.ledger" in loaded or found["state"][0] == "pending", found["state"]
