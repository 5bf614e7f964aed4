# SPDX-License-Identifier: Apache-2.0
"""NVFP4 format constants (docs/NVFP4-FORMAT.md §3.1-3.2), torch-free, in one place: the serving
code, the CLI and anything built on them agree on the same table and limits.
"""

from __future__ import annotations

#: Largest finite E2M1 magnitude.
FP4_MAX = 6.0
#: Largest finite float8_e4m3fn magnitude; block scales saturate here.
E4M3_MAX = 448.0
#: Smallest positive (subnormal) float8_e4m3fn value.
E4M3_MIN_SUBNORMAL = 2.0 ** -9
#: Elements per block scale (NVFP4 uses 16 along the contraction/last dim).
BLOCK_SIZE = 16

#: Value of each 4-bit code ``s*8 + e*2 + m``. Code 8 is -0.0, so decoding keeps the sign of zero.
E2M1_TABLE = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# The largest max/min ratio of one layer's per-expert input scales a calibrated checkpoint can
# hold. The experts of one layer see the same hidden states; an expert whose input scale is
# ``spread`` x the smallest quantizes them with FP8-E4M3 block scales about 448 / spread. Below
# E4M3's smallest subnormal, 2**-9, every block scale rounds to 0 and that expert's input
# becomes all zeros: no calibration produces that.
MAX_INPUT_SCALE_SPREAD = E4M3_MAX / E4M3_MIN_SUBNORMAL  # 229376
