"""The plugin in the engine worlds as a user installs it: from its built wheel.

Why: the accuracy table serves the model with the plugin installed from its built wheel, so what the
engines load is what ``pip install`` gives a user (entry point, package data, no checkout on
``sys.path``), not an editable checkout. The wheel is rebuilt and reinstalled only when the
package source changed (``SOURCES``' hash, kept in ``<venv>/.plugin-wheel``), so
``scripts/bootstrap-engine.sh`` stays cheap to re-run; the engine drivers (server.py,
engine.py) refuse to start an engine on a stale or shadowed install, naming the command that
fixes it.

Standard library only, like the drivers. CLI (scripts/bootstrap-engine.sh)::

    python tests/engine/plugin_wheel.py install VENV_DIR
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

REPO_ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_fp4_moe_plugin"
# what the wheel is built from; HASHED decides when it is rebuilt: README.md (setup.cfg's long
# description) only changes the wheel's metadata, not what an engine runs, and is edited often
SOURCES = (PACKAGE, "setup.cfg", "pyproject.toml", "README.md")
HASHED = (PACKAGE, "setup.cfg", "pyproject.toml")
STAMP = ".plugin-wheel"


def _files(names: tuple = SOURCES) -> list[Path]:
    out = []
    for name in names:
        p = REPO_ROOT / name
        if not p.exists():
            continue  # not a full checkout: the hash then matches no build
        out += sorted(f for f in p.rglob("*") if f.is_file() and "__pycache__" not in f.parts
                      and f.suffix != ".pyc") if p.is_dir() else [p]
    return out


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
    """Build the wheel from a clean copy of the sources and install it (not editable, no
    dependencies: the world's vLLM is the user's) when the source changed."""
    want = source_hash()
    if _stamp(venv).get("source_sha256") == want:
        return f"{venv.name}: plugin wheel up to date"
    py = venv / "bin" / "python"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        for f in _files():  # a copy: setuptools would reuse a stale build/lib of the checkout
            dst = src / f.relative_to(REPO_ROOT)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst)
        subprocess.run([str(py), "-m", "pip", "wheel", "-q", "--no-deps", "-w",
                        str(Path(tmp) / "dist"), str(src)], check=True)
        (wheel,) = (Path(tmp) / "dist").glob("*.whl")
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
                        str(wheel)], check=True)
    (venv / STAMP).write_text(json.dumps({"source_sha256": want, "wheel": wheel.name}) + "\n")
    return f"{venv.name}: installed {wheel.name}"


PROBE = (f"import importlib.metadata as m, {PACKAGE} as p; "
         f"d = m.distribution('vllm-fp4-moe-plugin'); "
         f"print(p.__file__); print(d.read_text('direct_url.json') or '')")


@functools.cache
def check(venv: Path, world: str) -> None:
    """Raise unless ``venv`` imports the plugin from the wheel of the current source, the way
    the drivers start engines (cwd outside the checkout, no PYTHONPATH)."""
    fix = f"run ./scripts/bootstrap-engine.sh {world}"
    if _stamp(venv).get("source_sha256") != source_hash():
        raise RuntimeError(f"{venv}: the plugin wheel there is not built from this checkout's "
                           f"current source ({PACKAGE}/, setup.cfg, ...): {fix}")
    p = subprocess.run([str(venv / "bin" / "python"), "-c", PROBE], capture_output=True,
                       text=True, cwd=tempfile.gettempdir(), timeout=300,
                       env={"PATH": "/usr/bin:/bin"})
    lines = p.stdout.splitlines()
    if (p.returncode != 0 or not lines or '"editable"' in p.stdout
            or not Path(lines[0]).resolve().is_relative_to(venv.resolve())):
        raise RuntimeError(f"{venv}: {PACKAGE} does not import from an installed wheel "
                           f"({(lines or [p.stderr[-300:]])[0]}): {fix}")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "install":
        print(__doc__, file=sys.stderr)
        return 2
    print("[plugin-wheel]", install(Path(argv[1]).resolve()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
