# SPDX-License-Identifier: Apache-2.0
"""FlashInfer 0.7.x's own TRT-LLM weight-shuffle helpers, run on CPU from the released wheel.

vLLM 0.34.0 pins flashinfer-python 0.7.3, which the package index does not carry (0.7.2.post1
and 0.7.4 it does; their helpers below differ only in docstrings and assertion messages). The
package cannot be installed into ``.venv-vllm-0.34.0``: the TRT-LLM seam stands in for
FlashInfer only where it is absent (``blackwell_oracle.simulated_blackwell``), and importing it
needs ``pynvml`` and its JIT machinery. The helpers are plain torch index arithmetic, so this
module reads their source out of the wheel (a zip; nothing is unpacked or installed), takes the
named top-level functions and constants and whatever top-level names they use from the same
files, drops their decorators (``flashinfer_api`` logging) and executes them in a namespace of
their own. ``block_scale_interleave`` is the one exception: FlashInfer JIT-builds it for the
device's SM (``quantization/fp4_quantization.py``, 0.7.4:1439-1499), so the caller hands in a
stand-in, exactly as tests/nvfp4 does for FlashInfer 0.3.1.

Which wheels: those of the FlashInfer series the installed vLLM pins (its ``flashinfer-python``
requirement, read from vLLM's metadata): ``0.7.*`` for vLLM 0.34.0 (``==0.7.3``), ``0.6.*`` for
vLLM 0.20.0 (``==0.6.8.post1``, which the index does carry). They are looked for in
``$VLLM_FP4_MOE_FLASHINFER_WHEELS``, default ``<virtualenv>/flashinfer-wheels``
(``scripts/bootstrap-release.sh 0.34.0`` downloads the 0.7.x ones there, ``pip download
--no-deps``; for another release, ``pip download --no-deps flashinfer-python==<its pin>``).
A name is ``None`` in :func:`load`'s answer only where :data:`OPTIONAL` allows it: the wheel
has no file for it at all (FlashInfer 0.6.x has no ``trace/templates/gemm.py``).
"""

from __future__ import annotations
import __future__

import ast
import importlib.metadata
import os
import re
import sys
import typing
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import torch

# Where each helper lives in a 0.7.x wheel (0.7.4 line numbers).
FILES = (
    "flashinfer/utils.py",  # get_shuffle_matrix_a_row_indices :1146, ..._sf_a_... :1182
    "flashinfer/fused_moe/core.py",  # _maybe_get_cached_w3_w1_permute_indices :682, w2 :721
    "flashinfer/quantization/fp4_quantization.py",  # shuffle_matrix_a :1586, ..._sf_a :1608
    "flashinfer/trace/templates/gemm.py",  # _unswizzle_batched_sf_128x4 :142 (128x4 reader)
)
NAMES = ("get_shuffle_matrix_a_row_indices", "get_shuffle_matrix_sf_a_row_indices",
         "get_reorder_rows_for_gated_act_gemm_row_indices", "reorder_rows_for_gated_act_gemm",
         "_maybe_get_cached_w3_w1_permute_indices", "get_w2_permute_indices_with_cache",
         "shuffle_matrix_a", "shuffle_matrix_sf_a", "_unswizzle_batched_sf_128x4")
# Name -> the file an older wheel may lack altogether, and the name with it: the 128x4 reader's
# trace/templates/gemm.py is not in the 0.6.8.post1 wheel (vLLM 0.20.0's pin). Where the file is
# there, the name must be too.
OPTIONAL = {"_unswizzle_batched_sf_128x4": "flashinfer/trace/templates/gemm.py"}


def wheel_dir() -> Path:
    default = Path(sys.prefix) / "flashinfer-wheels"
    return Path(os.environ.get("VLLM_FP4_MOE_FLASHINFER_WHEELS", default))


def pinned() -> Optional[str]:
    """The ``flashinfer-python`` version the installed vLLM requires (``==X``), as its metadata
    states it (vLLM 0.34.0: 0.7.3; 0.20.0: 0.6.8.post1); None if it pins none."""
    for req in importlib.metadata.requires("vllm") or ():
        m = re.match(r"flashinfer[-_]python\s*==\s*([0-9][^\s;,]*)", req, re.I)
        if m:
            return m.group(1)
    return None


def pattern() -> str:
    """The wheel names looked for: the pinned version's ``major.minor`` series."""
    pin = pinned()
    return "flashinfer_python-" + (".".join(pin.split(".")[:2]) + ".*" if pin else "<no pin>") \
        + "-py3-none-any.whl"


def wheels() -> list[Path]:
    """The FlashInfer wheels of the pinned series on hand, oldest first."""
    return sorted(wheel_dir().glob(pattern())) if pinned() else []


def _top_level(tree: ast.Module) -> dict[str, ast.stmt]:
    out: dict[str, ast.stmt] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node
    return out


def _uses(node: ast.stmt) -> list[str]:
    """Names a definition reads when it runs (decorators dropped, annotations left out)."""
    if isinstance(node, ast.FunctionDef):
        node.decorator_list = []
        parts = node.body + node.args.defaults + [d for d in node.args.kw_defaults if d]
    else:
        parts = [node]
    return [n.id for part in parts for n in ast.walk(part) if isinstance(n, ast.Name)]


def load(wheel: Path, overrides: dict) -> SimpleNamespace:
    """The helpers of ``wheel`` (``NAMES``), with every name in ``overrides`` bound to the
    given object instead of FlashInfer's (and not looked for in the sources)."""
    defs: dict[str, ast.stmt] = {}
    with zipfile.ZipFile(wheel) as z:
        present = set(z.namelist())
        for name in FILES:
            if name not in present:  # e.g. trace/templates/gemm.py before 0.7
                continue
            for key, node in _top_level(ast.parse(z.read(name).decode(), name)).items():
                defs.setdefault(key, node)
    wanted, todo = [], list(NAMES)
    while todo:
        name = todo.pop()
        if name in overrides or name not in defs or defs[name] in wanted:
            continue
        node = defs[name]
        wanted.append(node)
        todo.extend(_uses(node))
    # Annotations stay unevaluated: they name typing aliases FlashInfer imports.
    code = compile(ast.Module(body=wanted, type_ignores=[]), f"<{wheel.name}>", "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    ns = {"torch": torch, "typing": typing, **overrides}
    exec(code, ns)  # FlashInfer's own code, from its released wheel (see the module docstring)
    missing = [n for n in NAMES if n not in ns and (n not in OPTIONAL or OPTIONAL[n] in present)]
    if missing:
        raise LookupError(f"{wheel.name} has no top-level {missing} in {FILES}")
    return SimpleNamespace(**{n: ns.get(n) for n in NAMES}, version=wheel.name.split("-")[1])
