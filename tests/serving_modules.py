# SPDX-License-Identifier: Apache-2.0
"""What the wheel users install may hold: the serving code and the operator commands (audit,
doctor), nothing of the development package (lab/fp4_moe_lab). The allow-list is the serving
package's source tree, derived, read by tests/tools/test_wheel.py (the built wheel's files, both
ways) and tests/plugin/test_serving_imports.py (what a vLLM process with the plugin on imports);
what keeps lab code out of that tree is the import-layer test (tests/ut) and review."""

from __future__ import annotations

from pathlib import Path

PACKAGE = "vllm_fp4_moe_plugin"
LAB_PACKAGE = "fp4_moe_lab"


def _package_modules(root: Path) -> frozenset:
    """Every module of the serving package's source tree (what its wheel must hold)."""
    return frozenset(".".join(p.relative_to(root.parent).with_suffix("").parts)
                     .removesuffix(".__init__") for p in root.rglob("*.py")
                     if "__pycache__" not in p.parts)


SERVING_MODULES = _package_modules(Path(__file__).resolve().parents[1] / PACKAGE)

# The serving code stays small enough to review: physical lines of every Python file in the wheel
# (4,992 with the scale fixes; 5,187 with vLLM CUTLASS's route fix and its probe; 5,702 with the
# gate/up carry, the uncalibrated rule's window and EP view, and dummy weights; 5,761
# with Marlin's carry; 6,124 with the repair in front of upstream/0002's refusal and Llama-4's
# router weight counted once; 6,311 with the layer folders' docstrings, the one-module patch form
# and the router weight on 0.11.1-0.13.x's DP-chunked forward).
MAX_SERVING_LINES = 6400


def module_of(path: str) -> str:
    """``vllm_fp4_moe_plugin/patches/__init__.py`` -> ``vllm_fp4_moe_plugin.patches``."""
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

