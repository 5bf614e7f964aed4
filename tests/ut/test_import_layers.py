# SPDX-License-Identifier: Apache-2.0
"""The package's imports obey docs/ARCHITECTURE.md's layer table: no upward import, no cycle.

Read with ``ast`` (nothing is imported), function-local imports included: a lazy import that
closes a circle is still a circle. The table is the one place the layers are written down."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = "vllm_fp4_moe_plugin"


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / PKG).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _targets(node, package: str) -> list[str]:
    """What one import statement imports: absolute module names (any package)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        up = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(up + ([node.module] if node.module else []))
    # ``from pkg import sub`` imports the submodule sub; ``from mod import name``, mod.
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _own(target: str):
    """The package module ``target`` names, or None for another package."""
    if target != PKG and not target.startswith(PKG + "."):
        return None
    while target not in MODULES:
        target = target.rsplit(".", 1)[0]
    return target


def _package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def _ancestors(module: str) -> set[str]:
    """The packages whose ``__init__`` Python runs before ``module`` (the root excluded: every
    module's, run before anything else)."""
    parts = module.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def _imports(name: str, path: Path) -> set[str]:
    """The package modules ``name`` imports anywhere in its file, and the packages such an
    import initialises on the way (``a.b.c`` runs ``a.b``'s ``__init__``) that ``name`` is not
    already inside: a cycle through a package's ``__init__`` is a cycle too."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        for target in _targets(node, _package_of(name, path)):
            own = _own(target)
            if own is not None and own != name:
                found.add(own)
                found |= _ancestors(own) - _ancestors(name) - {name}
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer_table() -> dict[str, int]:
    """pattern -> layer, from the table in docs/ARCHITECTURE.md."""
    table = {}
    for line in (ROOT / "docs" / "ARCHITECTURE.md").read_text().splitlines():
        m = re.match(r"^\| (\d+) [a-z]+ \| (.+?) \|", line)
        if m:
            for pattern in re.findall(r"`([^`]+)`", m[2]):
                table[pattern] = int(m[1])
    assert table, "docs/ARCHITECTURE.md has no layer table"
    return table


TABLE = _layer_table()


def layer_of(module: str) -> int:
    """The layer of the table's most specific pattern for ``module`` (``x.*``: x and below)."""
    short = module[len(PKG) + 1:] if module != PKG else PKG
    best = None
    for pattern, layer in TABLE.items():
        stem = pattern[:-2] if pattern.endswith(".*") else pattern
        hit = short == stem or (pattern.endswith(".*") and short.startswith(stem + "."))
        rank = (len(stem), not pattern.endswith(".*"))  # the longest; a name over a ``.*``
        if hit and (best is None or rank > best[0]):
            best = (rank, layer)
    assert best is not None, f"{module} is in no layer of docs/ARCHITECTURE.md's table"
    return best[1]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_only_its_own_layer_or_below(module):
    mine = layer_of(module)
    upward = sorted(t for t in GRAPH[module] if layer_of(t) > mine)
    assert not upward, f"{module} (layer {mine}) imports a higher layer: {upward}"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])


def test_the_table_names_only_modules_that_exist():
    for pattern in TABLE:
        stem = pattern[:-2] if pattern.endswith(".*") else pattern
        full = stem if stem == PKG else f"{PKG}.{stem}"
        assert full in MODULES, f"docs/ARCHITECTURE.md's layer table names {pattern}"


def test_the_analysis_sees_a_planted_upward_import(tmp_path):
    """The graph would catch a violation: the support model importing the ledger."""
    planted = tmp_path / "support.py"
    planted.write_text("def f():\n    from vllm_fp4_moe_plugin.patches import ledger\n")
    found = _imports(f"{PKG}.base.support", planted)
    assert f"{PKG}.patches.ledger" in found
    assert f"{PKG}.patches" in found  # the package's __init__ runs on the way
    assert layer_of(f"{PKG}.patches.ledger") > layer_of(f"{PKG}.base.support")


LAYER_PACKAGES = sorted(m for m in MODULES
                        if m.count(".") == 1 and MODULES[m].name == "__init__.py")


def test_the_top_level_folders_are_the_layer_table():
    """Each layer of the table is a folder of the package (or the entry point, the root alone):
    a module's place in the tree says its layer."""
    tops = {p.split(".")[0].rstrip("*") for p in TABLE if p != PKG}
    assert tops == {m.rsplit(".", 1)[1] for m in LAYER_PACKAGES}
    assert sorted(p.name for p in (ROOT / PKG).glob("*.py")) == ["__init__.py"]


@pytest.mark.parametrize("package", LAYER_PACKAGES + [f"{PKG}.tools.checkpoint"])
def test_a_layer_folder_init_holds_only_its_docstring(package):
    """Nothing runs when a layer's folder is imported: no import to close a cycle through it, no
    logic a reader must look for in an ``__init__``."""
    body = ast.parse(MODULES[package].read_text()).body
    assert len(body) == 1 and isinstance(body[0], ast.Expr), package


def _one_module_patches() -> list[str]:
    """What ``patches/registry.py`` imports by name (modules assigning ``PATCH``), read as it
    reads them: a dynamic import the graph above does not see."""
    return sorted(f"{PKG}.patches.{p.stem}" for p in (ROOT / PKG / "patches").glob("*.py")
                  if re.search(r"^PATCH\s*[:=]", p.read_text(), re.M))


ONE_MODULE_PATCHES = _one_module_patches()


@pytest.mark.parametrize("module", ONE_MODULE_PATCHES)
def test_a_one_module_patch_is_in_the_registrys_layer(module):
    assert layer_of(module) <= layer_of(f"{PKG}.patches.registry"), module


VLLM_FREE_AT_IMPORT = ONE_MODULE_PATCHES + [m for m in MODULES if layer_of(m) == 0] + [
    f"{PKG}.base", f"{PKG}.scales", f"{PKG}.scales.scale_rule", f"{PKG}.scales.nvfp4_constants",
    f"{PKG}.tools", f"{PKG}.tools.checkpoint", f"{PKG}.tools.checkpoint.tensor_index",
    f"{PKG}.patches.patching", f"{PKG}.patches.probing", f"{PKG}.patches.compat", f"{PKG}.patches",
    f"{PKG}.patches.registry", f"{PKG}.patches.bf16_passthrough", f"{PKG}.patches.fleet",
    f"{PKG}.patches.fleet_rendezvous", f"{PKG}.patches.plugin_env"] + [
    f"{PKG}.patches.{d}{probe}" for d in ("init_prepare_finalize", "modular_method",
                                           "nvfp4_oracle") for probe in ("", ".probe")]


@pytest.mark.parametrize("module", sorted(VLLM_FREE_AT_IMPORT))
def test_vllm_free_modules_import_no_vllm_at_module_level(module):
    path = MODULES[module]
    for node in ast.parse(path.read_text()).body:  # module level: functions may import vLLM
        names = _targets(node, _package_of(module, path))
        assert not any(n == "vllm" or n.startswith("vllm.") for n in names), (module, names)
        for n in filter(None, map(_own, names)):  # and what they import is vLLM-free too
            assert n in VLLM_FREE_AT_IMPORT, (module, n)


LAB = "fp4_moe_lab"


def _lab_imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(enclosing function or '<module>', line) of every import of the lab in one module."""
    found = []

    def walk(node, where):
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef,
                                                     ast.AsyncFunctionDef)) else where
            if any(t == LAB or t.startswith(LAB + ".")
                   for t in _targets(child, _package_of(name, path))):
                found.append((where, child.lineno))
            walk(child, inner)

    walk(ast.parse(path.read_text()), "<module>")
    return found


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_serving_package_never_imports_the_lab(module):
    """The lab (lab/fp4_moe_lab) imports the serving package, not the other way round, not even
    inside a function: the wheel users install has no lab, and no import runs in a circle."""
    bad = _lab_imports(module, MODULES[module])
    assert not bad, f"{module} imports {LAB} at {bad}"


def test_the_analysis_sees_a_planted_lab_import(tmp_path):
    planted = tmp_path / "scales.py"
    planted.write_text("from fp4_moe_lab.nvfp4 import quantize\n\ndef f():\n"
                       "    from fp4_moe_lab import commands\n")
    assert _lab_imports(f"{PKG}.scales", planted) == [("<module>", 1), ("f", 4)]


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_serving_package_does_not_name_the_lab(module):
    """Not even in a docstring: a reader of the wheel meets no tool it does not ship."""
    text = MODULES[module].read_text()
    assert LAB not in text and "vllm-fp4-moe-lab" not in text, module
