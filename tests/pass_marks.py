# SPDX-License-Identifier: Apache-2.0
"""The tests' own acceptance numbers, kept here rather than imported from the code under test:
a change to the code's bound cannot loosen what the tests accept.

PLUGIN_BOUND: the plugin's error against the ideal NVFP4 reference of the layout; what is left
there is bf16 rounding of the output (2^-8 relative) and bf16 all-reduce/reduce-scatter.
FP32_FACTOR: the plugin's error against fp32 may exceed NVFP4's own noise floor by this factor.
AFFECTED_FACTOR: a hole shows when stock is at least this many times the bound away.
"""

PLUGIN_BOUND = 1e-2
FP32_FACTOR = 1.1
AFFECTED_FACTOR = 10.0
