# SPDX-License-Identifier: Apache-2.0
"""NVFP4 math, scale layouts, a FlashInfer 0.3.1 contract emulator and fp32 oracles.

Pure torch (no vLLM / FlashInfer / compressed-tensors imports), any device: the plugin's tests
use it to reproduce vLLM 0.11.0's activation-scale bug on CPU and to check the fix.
"""

from .constants import BLOCK_SIZE, E2M1_VALUES, E4M3_MAX, FP4_MAX
from .e2m1 import e2m1_decode, e2m1_round, pack_fp4, unpack_fp4
from .flashinfer_contract import fp4_quantize
from .fused_moe_emulator import cutlass_fused_moe
from .kernel_inputs import to_flashinfer_inputs
from .layout import block_scale_interleave, sf_offset_128x4, swizzle_128x4, unswizzle_128x4
from .quantize import CONVENTIONS, dequantize, e4m3_rne_sat, global_scale, quantize, quantize_codes
from .reference import (
    QuantizedExperts,
    moe_reference_fp32,
    moe_reference_nvfp4,
    quantize_experts,
    random_experts,
    random_master,
)
from .trtllm_emulator import trtllm_fp4_block_scale_moe

__all__ = [
    "BLOCK_SIZE", "CONVENTIONS", "E2M1_VALUES", "E4M3_MAX", "FP4_MAX",
    "QuantizedExperts", "block_scale_interleave", "cutlass_fused_moe", "dequantize",
    "e2m1_decode", "e2m1_round", "e4m3_rne_sat", "fp4_quantize", "global_scale",
    "moe_reference_fp32", "moe_reference_nvfp4", "pack_fp4", "quantize", "quantize_codes",
    "quantize_experts", "random_experts", "random_master", "sf_offset_128x4", "swizzle_128x4",
    "to_flashinfer_inputs", "trtllm_fp4_block_scale_moe", "unpack_fp4", "unswizzle_128x4",
]
