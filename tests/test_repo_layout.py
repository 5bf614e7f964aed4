"""The repository's folders share code through the lab package (``fp4_moe_lab``) only: no
file imports another top-level folder's scripts, and none edits ``sys.path`` to reach one.

Read with ``ast`` (nothing is imported). The accuracy scripts that run by path in other
virtualenvs (quantize, train) import their siblings by bare name, which Python allows for a
script's own folder."""

import ast
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.unit]

ROOT = Path(__file__).resolve().parents[1]
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
