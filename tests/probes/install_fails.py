# SPDX-License-Identifier: Apache-2.0
"""A patch that fails to install inside vLLM's own import of its quant module refuses to serve,
also on a retry, and leaves every vLLM symbol as it was.

Usage: python install_fails.py TARGET [OTHER_TARGET ...] (with VLLM_FP4_MOE_PLUGIN=1): TARGET's
patch raises. Prints ``REFUSED 1``/``REFUSED 2`` (or ``SERVED UNPATCHED n``). Run by
tests/plugin/test_all_or_nothing.py."""

import sys

import vllm_fp4_moe_plugin as plugin
from vllm_fp4_moe_plugin.patches import ledger, patching

target, targets = sys.argv[1], sys.argv[1:]  # the probe itself would import vLLM's MoE code
real = patching.ModulePatch.apply


def apply(self):
    if self.target == target:
        raise RuntimeError("injected failure")
    return real(self)


patching.ModulePatch.apply = apply
plugin.register()
assert plugin.state()[0] == "pending"
from vllm.model_executor.layers.quantization import get_quantization_config  # noqa: E402

for attempt in (1, 2):  # what vLLM does while verifying a ModelConfig; and a retry
    try:
        get_quantization_config("modelopt_fp4")
    except ledger.PatchInstallError as exc:
        assert target in str(exc), exc
        print("REFUSED", attempt)
    else:
        print("SERVED UNPATCHED", attempt)
assert plugin.state()[0] == "failed", plugin.state()
assert ledger.applied_targets() == []
for t in targets:
    module, _, attr = t.rpartition(".")
    if module in sys.modules:
        assert getattr(sys.modules[module], attr).__module__.startswith("vllm."), t
