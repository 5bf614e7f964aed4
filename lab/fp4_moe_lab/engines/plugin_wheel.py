# SPDX-License-Identifier: Apache-2.0
"""The plugin in the engine worlds as a user installs it: from its built wheel.

Why: the accuracy table serves the model with the plugin installed from its built wheel, so what the
engines load is what ``pip install`` gives a user (entry point, package data, no checkout on
``sys.path``), not an editable checkout. Next to it goes the wheel of the development package
(lab/, ``fp4_moe_lab``, never published): the test-only seam plugin (tests/engine/seam_plugin)
runs the lab's simulated Blackwell inside the engines. Both wheels are rebuilt and reinstalled
only when their source changed (``HASHED``' hash, kept in ``<venv>/.plugin-wheel``), so
``scripts/bootstrap-engine.sh`` stays cheap to re-run; the engine drivers (server.py,
engine.py) refuse to start an engine on a stale or shadowed install, naming the command that
fixes it.

Standard library only, like the drivers. CLI (scripts/bootstrap-engine.sh)::

    python -m fp4_moe_lab.engines.plugin_wheel install VENV_DIR
"""

from __future__ import annotations

import functools
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from fp4_moe_lab.checkout import ROOT as REPO_ROOT

PACKAGE = "vllm_fp4_moe_plugin"
# what the wheel is built from; HASHED decides when it is rebuilt: README.md (setup.cfg's long
# description) only changes the wheel's metadata, not what an engine runs, and is edited often
SOURCES = (PACKAGE, "setup.cfg", "pyproject.toml", "README.md")
HASHED = (PACKAGE, "setup.cfg", "pyproject.toml", "lab")
LAB = "lab"  # the development package's distribution (lab/pyproject.toml): its own wheel
LAB_PACKAGE = "fp4_moe_lab"
STAMP = ".plugin-wheel"


def _files(names: tuple = SOURCES) -> list[Path]:
    out = []
    for name in names:
        p = REPO_ROOT / name
        if not p.exists():
            continue  # not a full checkout: the hash then matches no build
        out += sorted(f for f in p.rglob("*") if f.is_file() and not _output(f)) \
            if p.is_dir() else [p]
    return out


def _output(f: Path) -> bool:
    """A build output or cache (an editable install of lab/ leaves lab/*.egg-info)."""
    return f.suffix == ".pyc" or any(part == "__pycache__" or part.endswith(".egg-info")
                                     or part == "build" for part in f.parts)


def source_hash() -> str:
    h = hashlib.sha256()
    for f in _files(HASHED):
        h.update(str(f.relative_to(REPO_ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _stamp(venv: Path) -> dict:
    try:
        return json.loads((venv / STAMP).read_text())
    except (OSError, ValueError):
        return {}


def install(venv: Path) -> str:
    """Build the plugin's and the lab's wheels from a clean copy of the sources and install
    both (not editable, no dependencies: the world's vLLM is the user's) when the source
    changed."""
    want = source_hash()
    if _stamp(venv).get("source_sha256") == want:
        return f"{venv.name}: plugin and lab wheels up to date"
    py = venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        # a copy: setuptools would reuse a stale build/lib of the checkout
        for f in _files(SOURCES + (LAB,)):
            dst = src / f.relative_to(REPO_ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
        wheels = []
        for root, dist in ((src, "plugin"), (src / LAB, "lab")):
            out = Path(tmp) / f"dist-{dist}"
            subprocess.run([str(py), "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                            str(root)], check=True)
            wheels += list(out.glob("*.whl"))
        assert len(wheels) == 2, wheels
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        *map(str, wheels)], check=True)
    names = [w.name for w in wheels]
    (venv / STAMP).write_text(json.dumps({"source_sha256": want, "wheel": names[0],
                                          "lab_wheel": names[1]}) + "\n")
    return f"{venv.name}: installed {', '.join(names)}"


# the world's view of the plugin and the lab (a program file: any Python can run it)
PROBE = REPO_ROOT / "tests" / "probes" / "installed_from_wheel.py"


@functools.cache
def check(venv: Path, world: str) -> None:
    """Raise unless ``venv`` imports the plugin from the wheel of the current source, the way
    the drivers start engines (cwd outside the checkout, no PYTHONPATH)."""
    fix = f"run ./scripts/bootstrap-engine.sh {world}"
    if _stamp(venv).get("source_sha256") != source_hash():
        raise RuntimeError(f"{venv}: the plugin and lab wheels there are not built from this "
                           f"checkout's current source ({PACKAGE}/, lab/, setup.cfg, ...): {fix}")
    p = subprocess.run([str(venv / "bin" / "python"), str(PROBE)], capture_output=True,
                       text=True, cwd=tempfile.gettempdir(), timeout=300,
                       env={"PATH": "/usr/bin:/bin"})
    lines = p.stdout.splitlines()
    if (p.returncode != 0 or len(lines) < 2 or '"editable"' in p.stdout
            or not all(Path(f).resolve().is_relative_to(venv.resolve()) for f in lines[:2])):
        raise RuntimeError(f"{venv}: {PACKAGE} or {LAB_PACKAGE} does not import from an "
                           f"installed wheel ({(lines or [p.stderr[-300:]])[:2]}): {fix}")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "install":
        print(__doc__, file=sys.stderr)
        return 2
    print("[plugin-wheel]", install(Path(argv[1]).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
