# SPDX-License-Identifier: Apache-2.0
"""What a fresh virtualenv with only the plugin's wheel (and a view of vLLM) sees: the plugin's
distributions, its entry point, the module vLLM's plugin loader loads, and the state after
register() and after vLLM's NVFP4 MoE import. Run from outside the checkout, with no PYTHONPATH,
by tests/tools/test_wheel.py. Prints ``PROBE {json}``."""

import importlib.metadata as md
import json

dists = [d for d in md.distributions()
         if (d.metadata["Name"] or "").lower().replace("_", "-") == "vllm-fp4-moe-plugin"]
eps = [ep for ep in md.entry_points(group="vllm.general_plugins") if ep.name == "fp4_moe"]
import vllm_fp4_moe_plugin as plugin  # noqa: E402

loaded = eps[0].load() if len(eps) == 1 else None
from vllm.plugins import load_general_plugins  # noqa: E402

load_general_plugins()  # vLLM's own loader calls register(), as in every vLLM process
after_register = plugin.state()
import vllm.model_executor.layers.quantization.modelopt  # noqa: E402,F401  (the trigger)

print("PROBE " + json.dumps({
    "dists": [str(d.locate_file("")) for d in dists],
    "direct_url": [json.loads(d.read_text("direct_url.json") or "{}") for d in dists],
    "entry_points": [ep.value for ep in eps],
    "entry_point_is_register": loaded is plugin.register,
    "plugin_file": plugin.__file__,
    "vllm_version": md.version("vllm"),
    "after_register": list(after_register),
    "state": list(plugin.state()),
}))
