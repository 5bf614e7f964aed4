# SPDX-License-Identifier: Apache-2.0
"""The tests' own acceptance numbers, kept here rather than imported from the code under test:
a change to the code's bound cannot loosen what the tests accept.

PLUGIN_BOUND: the plugin's error against the ideal NVFP4 reference of the layout; what is left
there is bf16 rounding of the output (2^-8 relative) and bf16 all-reduce/reduce-scatter.
FP32_FACTOR: the plugin's error against fp32 may exceed NVFP4's own noise floor by this factor.
AFFECTED_FACTOR: a hole shows when stock is at least this many times the bound away.
ROUTER_WEIGHT_ONCE: Llama-4's router-weight rows (its shared expert added in bf16, as the model
adds it): fp32 rounding, or, under TP, a bf16 ulp (2^-8 = 3.9e-03): vLLM 0.34.0's runner adds each
rank's half of the shared expert to the routed partial sum before the all-reduce (measured
3.4e-03), the reference adds once.
"""

PLUGIN_BOUND = 1e-2
FP32_FACTOR = 1.1
AFFECTED_FACTOR = 10.0


def router_weight_once(tp: int) -> float:
    return 5e-3 if tp > 1 else 1e-4
