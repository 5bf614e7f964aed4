# SPDX-License-Identifier: Apache-2.0
"""NVFP4 format constants as the emulators use them: the numbers live in the serving package
(:mod:`vllm_fp4_moe_plugin.scales.nvfp4_constants`); this module adds the E2M1 table as a tensor."""

from __future__ import annotations

import torch

from vllm_fp4_moe_plugin.scales.nvfp4_constants import BLOCK_SIZE, E2M1_TABLE, E4M3_MAX, FP4_MAX

__all__ = ["BLOCK_SIZE", "E2M1_VALUES", "E4M3_MAX", "FP4_MAX"]

#: Value of each 4-bit code ``s*8 + e*2 + m``, as float32 (code 8 is -0.0).
E2M1_VALUES = torch.tensor(E2M1_TABLE, dtype=torch.float32)
