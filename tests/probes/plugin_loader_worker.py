# SPDX-License-Identifier: Apache-2.0
"""A fresh worker-like vLLM process: vLLM's logging setup, then its plugin loader, then the
compressed-tensors NVFP4 MoE method's module. Prints ``RESULT {json}``: the plugin's state and
which helper the method's conversion would call. Run by tests/nvfp4_oracle/test_plugin_loading.py.

Usage: python plugin_loader_worker.py CT_MODULE ORACLE_MODULE HELPER_NAME"""

import importlib
import json
import sys

import vllm.logger
from vllm.plugins import load_general_plugins

ct_module, oracle_module, helper = sys.argv[1:4]
if hasattr(vllm.logger, "configure_logging"):
    # a multiproc worker's first step (v0.34.0 v1/executor/multiproc_executor.py:1000)
    from vllm.config.logging import LoggingConfig

    vllm.logger.configure_logging(LoggingConfig())
# else: no ``configure_logging`` nor ``vllm.config.logging`` (v0.20.0): importing vllm.logger
# configures vLLM's root logger itself (v0.20.0 logger.py:156-201, called at :241)
load_general_plugins()  # then init_worker's, before the worker is built
import vllm_fp4_moe_plugin as plugin  # noqa: E402

ct = importlib.import_module(ct_module)  # defines CompressedTensorsW4A4Nvfp4MoEMethod's PWAL
oracle = sys.modules[oracle_module]
# What PWAL calls: CT's convert_to_nvfp4_moe_kernel_format, which looks the helper up in the
# oracle module's globals at call time.
convert = ct.convert_to_nvfp4_moe_kernel_format
print("RESULT " + json.dumps({
    "state": plugin.state()[0],
    "convert_is_oracles": convert is oracle.convert_to_nvfp4_moe_kernel_format,
    "helper_module": convert.__globals__[helper].__module__,
}))
