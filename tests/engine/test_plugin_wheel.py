# SPDX-License-Identifier: Apache-2.0
"""The engine worlds serve the plugin from its built wheel (fp4_moe_lab.engines.plugin_wheel)."""

from __future__ import annotations

import json

import pytest

from fp4_moe_lab.engines import plugin_wheel, server


def test_stale_wheel_is_refused_with_the_command_that_fixes_it(tmp_path):
    (tmp_path / plugin_wheel.STAMP).write_text(json.dumps({"source_sha256": "0" * 64}))
    with pytest.raises(RuntimeError, match=r"not built from .* run \./scripts/bootstrap-engine"
                                           r"\.sh 0\.32\.0"):
        plugin_wheel.check.__wrapped__(tmp_path, "0.32.0")


def test_source_hash_covers_the_package_and_its_metadata():
    names = {str(f.relative_to(plugin_wheel.REPO_ROOT))
             for f in plugin_wheel._files(plugin_wheel.HASHED)}
    assert {"setup.cfg", "pyproject.toml", "vllm_fp4_moe_plugin/__init__.py",
            # the lab's wheel goes next to it (the seam plugin runs its simulated Blackwell)
            "lab/pyproject.toml", "lab/fp4_moe_lab/simulation/blackwell.py"} <= names
    assert "README.md" not in names  # metadata only: a doc edit must not make the worlds stale
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")
                or ".egg-info" in n]


# The worlds scripts/test.sh builds before this tier. The patched engine world
# (``0.32.0-patched``) is built on demand by scripts/bootstrap-patched.sh, and its wheel checked
# by ``server.start`` each time it serves.
BUILT_FOR_THE_TIER = ("0.11.0", "0.32.0")


@pytest.mark.parametrize("world", BUILT_FOR_THE_TIER)
def test_built_world_imports_the_current_wheel(world):
    venv = server.REPO_ROOT / server.WORLDS[world]
    assert server.world_python(world) is not None, \
        f"{venv} not built: ./scripts/bootstrap-engine.sh {world}"
    # Reference check: the stamp bootstrap-engine.sh wrote names the wheel it installed.
    stamp = json.loads((venv / plugin_wheel.STAMP).read_text())
    assert stamp["wheel"].endswith(".whl") and stamp["lab_wheel"].endswith(".whl")
    plugin_wheel.check.__wrapped__(venv, world)  # raises on a stale, editable or shadowed one
