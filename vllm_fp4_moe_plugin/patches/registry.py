# SPDX-License-Identifier: Apache-2.0
"""Every folder of the ledger: a design's slice (its records, its probe) or a slice for every
design. Adding a vLLM design's patches is adding its folder and naming it here. vLLM-free: the
records name their builders, imported only when a patch is applied."""

from __future__ import annotations

from vllm_fp4_moe_plugin.patches import (
    fleet_rendezvous,
    init_prepare_finalize,
    modular_method,
    nvfp4_oracle,
    plugin_env,
)
from vllm_fp4_moe_plugin.patches.patching import Slice

SLICES: tuple[Slice, ...] = tuple(folder.SLICE for folder in (
    init_prepare_finalize, modular_method, nvfp4_oracle, plugin_env, fleet_rendezvous))
DESIGNS = {s.design: s for s in SLICES if s.design is not None}
