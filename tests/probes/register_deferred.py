# SPDX-License-Identifier: Apache-2.0
"""register() in a fresh vLLM process (VLLM_FP4_MOE_PLUGIN=1 in the environment) imports no MoE
code, and the patch lands when vLLM first imports its NVFP4 MoE quantization modules.
Prints ``REGISTER_MS <ms>``. Run by tests/plugin/test_register.py."""

import sys
import time

import vllm  # noqa: F401  (what the time is measured after: every vLLM process has it)

t = time.perf_counter()
import vllm_fp4_moe_plugin as plugin  # noqa: E402

plugin.register()
elapsed_ms = (time.perf_counter() - t) * 1e3
assert "vllm.model_executor.layers.quantization.modelopt" not in sys.modules
assert plugin.state()[0] == "pending", plugin.state()
# What every vLLM process does while verifying a ModelConfig (config/model.py:879-930):
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402

get_quantization_config("modelopt_fp4")
from vllm.model_executor.layers.quantization import modelopt  # noqa: E402

assert plugin.state()[0] == "active", plugin.state()
assert modelopt.ModelOptNvFp4FusedMoE.__module__.startswith("vllm_fp4_moe_plugin")
print(f"REGISTER_MS {elapsed_ms:.3f}")
