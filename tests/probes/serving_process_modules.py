# SPDX-License-Identifier: Apache-2.0
"""A vLLM process with the plugin on (VLLM_FP4_MOE_PLUGIN=1 in the environment): vLLM's plugin
loader calls register(), then vLLM's NVFP4 MoE modules are imported so the patches install.
Prints ``MODULES {json}``: the plugin's state and every loaded module of the plugin or the lab.
Run by tests/plugin/test_serving_imports.py."""

import importlib
import json
import sys

from vllm.plugins import load_general_plugins

import vllm_fp4_moe_plugin as plugin

load_general_plugins()  # vLLM's own loader calls register(), as in every vLLM process
import vllm.model_executor.layers.quantization.modelopt  # noqa: E402,F401  (the trigger)

try:
    importlib.import_module(
        "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe")
except ImportError:  # a release that moved it: modelopt above is the trigger that matters
    pass
names = sorted(m for m in sys.modules if m.split(".")[0] in ("vllm_fp4_moe_plugin", "fp4_moe_lab"))
print("MODULES " + json.dumps({"state": list(plugin.state()), "modules": names}))
