# SPDX-License-Identifier: Apache-2.0
"""The repository's folders share code through the lab package (``fp4_moe_lab``) only: no
file imports another top-level folder's scripts, and none edits ``sys.path`` to reach one.

Read with ``ast`` (nothing is imported). The accuracy scripts that run by path in other
virtualenvs (quantize, train) import their siblings by bare name, which Python allows for a
script's own folder."""

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("accuracy", "benchmarks", "examples", "lab", "scripts", "tests")


def _python_files():
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if not any(part.startswith(".") or part.endswith(".egg-info")
                       for part in path.relative_to(ROOT).parts):
                yield folder, path


def _offences(folder: str, path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                 else [])
        for name in names:
            top = name.split(".")[0]
            if top in FOLDERS and top != folder:
                out.append(f"line {node.lineno}: imports {name} (another folder's scripts)")
        if (isinstance(node, ast.Attribute) and node.attr in ("insert", "append")
                and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
                and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"):
            out.append(f"line {node.lineno}: edits sys.path")
    return out


def test_folders_share_code_only_through_the_lab_package():
    found = {str(p.relative_to(ROOT)): o for f, p in _python_files() if (o := _offences(f, p))}
    assert not found, f"move shared code into lab/fp4_moe_lab instead: {found}"


def test_the_check_sees_both_kinds(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("import sys\nsys.path.insert(0, '..')\nfrom accuracy import table\n")
    assert len(_offences("tests", bad)) == 2
    assert _offences("accuracy", bad) == ["line 2: edits sys.path"]


# The project's own tracker is not part of the repository: its numbers mean nothing to a reader.
# Upstream reports are cited with their project and '#' (docs/CITATIONS.md), which this allows.
_TRACKER = re.compile(r"\bissues? \d+", re.IGNORECASE)


def _tracker_references(text: str) -> list[str]:
    return [m.group(0) for m in _TRACKER.finditer(text)]


def test_no_references_to_the_projects_own_tracker():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    found = {}
    for name in filter(None, files):
        try:
            text = (ROOT / name).read_text()
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary files (weights, images) and paths removed in the work tree
        if hits := _tracker_references(text):
            found[name] = hits
    assert not found, f"say what the thing is instead of a tracker number: {found}"


def test_the_tracker_check_allows_upstream_citations():
    ours = "see issue" + " 18 and Issues" + " 4"  # split so this file passes its own check
    assert _tracker_references(ours) == ["issue" + " 18", "Issues" + " 4"]
    assert _tracker_references("compressed-tensors issue #389; vLLM #27223") == []


def test_every_source_file_carries_the_license_header():
    """``# SPDX-License-Identifier: Apache-2.0`` on the first line (the second after a shebang)
    of every tracked Python and shell file, as vLLM and its plugins mark theirs."""
    files = subprocess.run(["git", "ls-files", "-z", "*.py", "*.sh", ".ci/run"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    missing = []
    for name in filter(None, files):
        path = ROOT / name
        if not path.exists():
            continue
        head = path.read_text().split("\n", 2)[:2]
        if "# SPDX-License-Identifier: Apache-2.0" not in head:
            missing.append(name)
    assert not missing, f"add the SPDX header to: {missing}"
