# SPDX-License-Identifier: Apache-2.0
"""What :mod:`.writer` accepts, importable without torch: the make-checkpoint and demo commands
check their output path with these before any slow import or tensor."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

# The largest --spread a calibrated checkpoint can hold is a format limit: it lives with the NVFP4
# constants of the serving package, where the CLI checks --spread at parse time.
from vllm_fp4_moe_plugin.scales.nvfp4_constants import MAX_INPUT_SCALE_SPREAD  # noqa: F401  (re-exported)

OWN_FILES = ("config.json", "hf_quant_config.json", "model.safetensors",
             "model.safetensors.index.json")

# Tiny checkpoints only: size overrides that would write more than this are refused up front.
MAX_CHECKPOINT_BYTES = 2 * 1024 ** 3


def output_dir_problem(out: Path, overwrite: bool) -> Optional[str]:
    """Why ``out`` cannot receive a checkpoint (without touching it), or None. The words name
    the problem, not the Python argument: callers add how to fix it."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory"
    parent = out
    while not parent.exists():  # the directory that would be created under
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory, so {out} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable"
    if not out.exists():
        return None
    names = sorted(p.name for p in out.iterdir())
    others = [n for n in names if not is_own_file(n)]
    if others:
        return (f"{out} holds files this writer did not create {others[:5]}; refusing to mix "
                "them into a checkpoint")
    if names and not overwrite:
        return f"{out} already holds a checkpoint ({names[:5]})"
    return None


def is_own_file(name: str) -> bool:
    return name in OWN_FILES or (name.startswith("model-") and name.endswith(".safetensors"))
