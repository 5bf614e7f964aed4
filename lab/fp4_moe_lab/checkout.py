# SPDX-License-Identifier: Apache-2.0
"""The repository checkout this lab is imported from: where the engine worlds (``.venv-engine*``),
the accuracy models and the docs the drivers write live.

The lab is installed editable from a checkout (``lab/fp4_moe_lab``, two folders below the root);
the engine worlds hold a built copy of it, from which none of the drivers run.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def is_checkout(root: Path = ROOT) -> bool:
    """Whether ``root`` is this repository's checkout (not ``site-packages``)."""
    return (root / "setup.cfg").is_file() and (root / "lab" / "pyproject.toml").is_file()
