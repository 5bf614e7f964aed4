# SPDX-License-Identifier: Apache-2.0
"""The release worlds the benchmarks run in, and which one this interpreter is.

A world is one installed vLLM with its own virtualenv in the checkout (``scripts/bootstrap*.sh``):
vLLM 0.11.0 in ``.venv`` (the init_prepare_finalize design, items 1-7) and vLLM 0.34.0
in ``.venv-vllm-0.34.0`` (the nvfp4_oracle design's rows). Which rows a world gets
follows from the design the installed vLLM probes as, never from a version string; the version
only names the world in the table and the JSON.
"""

from __future__ import annotations

from pathlib import Path

WORLD_VENVS = {"vllm-0.11.0": ".venv", "vllm-0.34.0": ".venv-vllm-0.34.0"}
LEGACY_ITEMS = (1, 2, 3, 4, 5, 6, 7)
ORACLE_ITEMS = (1, 2, 3, 4, 6, 8)


def current() -> str:
    from importlib.metadata import version

    return f"vllm-{version('vllm')}"


def is_oracle() -> bool:
    """The installed vLLM has the NVFP4 backend oracle (0.14.0+): the oracle world's rows."""
    from fp4_moe_lab.simulation import blackwell_oracle

    return blackwell_oracle.applies()


def design_label() -> str:
    return "nvfp4_oracle design" if is_oracle() else "init_prepare_finalize design"


def other_worlds(venv_root: Path) -> list[tuple[str, Path]]:
    """(world, python) of every world but this one whose virtualenv exists under
    ``venv_root``."""
    here = current()
    out = []
    for world, venv in WORLD_VENVS.items():
        python = venv_root / venv / "bin" / "python"
        if world != here and python.exists():
            out.append((world, python))
    return out
