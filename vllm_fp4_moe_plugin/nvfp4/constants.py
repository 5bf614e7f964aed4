"""NVFP4 format constants (docs/NVFP4-FORMAT.md §3.1-3.2).

Kept in one place so that every module (and every test) agrees on the same table and limits.
"""

from __future__ import annotations

import torch

#: Largest finite E2M1 magnitude.
FP4_MAX = 6.0
#: Largest finite float8_e4m3fn magnitude; block scales saturate here.
E4M3_MAX = 448.0
#: Elements per block scale (NVFP4 uses 16 along the contraction/last dim).
BLOCK_SIZE = 16

#: Value of each 4-bit code ``s*8 + e*2 + m``. Code 8 is -0.0, so decoding keeps the sign of zero.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
