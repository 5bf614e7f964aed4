# SPDX-License-Identifier: Apache-2.0
"""Every patch of the ledger: each design's folder (its records, its probe), the folders for every
design, and the one-module patches (a module of ``patches/`` that assigns ``PATCH``), each
added to the slices of the designs it names. A new patch is one such module: nothing here to
edit. vLLM-free: the records name their builders, imported only when a patch is applied."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

from vllm_fp4_moe_plugin.patches import (
    fleet_rendezvous,
    init_prepare_finalize,
    modular_method,
    nvfp4_oracle,
    plugin_env,
)
from vllm_fp4_moe_plugin.patches.patching import Patch, Slice

_HERE = Path(__file__).parent
# Read as text, not imported: only a module that assigns PATCH at its top level is one.
PATCH_MODULES = tuple(sorted(
    f"{__package__}.{path.stem}" for path in _HERE.glob("*.py")
    if re.search(r"^PATCH\s*[:=]", path.read_text(encoding="utf-8"), re.M)))
ONE_MODULE: tuple[Patch, ...] = tuple(importlib.import_module(m).PATCH for m in PATCH_MODULES)


def _with_one_module_patches(part: Slice) -> Slice:
    mine = tuple(p for p in ONE_MODULE if part.design is not None and part.design in p.designs)
    if not mine:
        return part
    return dataclasses.replace(
        part, patches=part.patches + tuple(e for p in mine for e in p.entries),
        findings=part.findings + tuple(f for p in mine for f in p.findings), extras=mine)


SLICES: tuple[Slice, ...] = tuple(_with_one_module_patches(folder.SLICE) for folder in (
    init_prepare_finalize, modular_method, nvfp4_oracle, plugin_env, fleet_rendezvous))
DESIGNS = {s.design: s for s in SLICES if s.design is not None}
