# SPDX-License-Identifier: Apache-2.0
"""One cold vLLM process, timed step by step: ``import vllm``, the plugin's entry-point module,
``register()``, then the NVFP4 MoE modules whose first import runs the probe and the patches
(register() hands the module's ``_install`` to the import hook: it is timed there). Prints
``BENCH {json}`` (seconds). Run by benchmarks/startup.py, once per process.

Usage: python -m benchmarks.startup_probe MODULES_JSON (from the repository root)"""

import importlib
import json
import sys
import time

modules = json.loads(sys.argv[1])
t0 = time.perf_counter()
import vllm  # noqa: E402,F401

t1 = time.perf_counter()
import vllm_fp4_moe_plugin  # noqa: E402

t2 = time.perf_counter()
install = []
_orig = vllm_fp4_moe_plugin._install


def _timed():
    s = time.perf_counter()
    _orig()
    install.append(time.perf_counter() - s)


vllm_fp4_moe_plugin._install = _timed
vllm_fp4_moe_plugin.register()
t3 = time.perf_counter()
for name in modules:
    importlib.import_module(name)
t4 = time.perf_counter()
print("BENCH" + json.dumps({"import_vllm": t1 - t0, "import_entry_point": t2 - t1,
                            "register": t3 - t2, "quant_modules": t4 - t3,
                            "install": sum(install),
                            "state": vllm_fp4_moe_plugin.state()[0]}))
