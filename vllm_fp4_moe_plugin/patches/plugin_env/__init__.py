# SPDX-License-Identifier: Apache-2.0
"""The slice of the ledger for every design: vLLM learns the plugin's environment variables
(why: the entry below). vLLM-free. ``register()`` applies it in every process when the switch is
on, before vLLM starts any worker; the MoE patches come later, when vLLM imports its NVFP4 MoE
modules.
"""

from __future__ import annotations

import os

from vllm_fp4_moe_plugin.base import envs
from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.patches.patching import ModulePatch, Slice, original_attr


def _reader(name: str):
    def read():  # the raw string, as vLLM's own readers return it: the plugin parses it
        return os.environ.get(name)
    return read


def build_registry(original: dict) -> dict:
    return {**original, **{n: _reader(n) for n in envs.environment_variables
                            if n not in original}}


def probe() -> dict[str, object]:
    """Does vLLM's registry of environment variables (``vllm.envs.environment_variables``, what
    its Ray env copy and its unknown-variable check read) list every variable of the plugin?
    Reads the registry as it is, through our own patch if applied."""
    registry = original_attr(vm.VLLM_ENVS, "environment_variables")
    return {"plugin_env_listed": all(n in registry for n in envs.environment_variables)}


def _unlisted(findings) -> bool:
    """vLLM's registry of environment variables does not list the plugin's (every release so
    far)."""
    return not findings["plugin_env_listed"]


# every MoE design: this is about how vLLM starts processes, not about MoE
SLICE = Slice(None, (ModulePatch(
    module=vm.VLLM_ENVS, attr="environment_variables", build=f"{__name__}:build_registry",
    needed=_unlisted,
    why=("Up to 0.13.x vLLM copies to Ray workers only the variables its registry lists (v0110 "
         "vllm/ray/ray_env.py:52-58): workers on other nodes would run stock vLLM. 0.2x+ warns "
         "of each unlisted VLLM_ variable and refuses to start with "
         "--fail-on-environ-validation (v0.32.0 vllm/platforms/interface.py:1446-1459)."),
    how=("Rebinds vllm.envs.environment_variables to a copy that also lists the plugin's "
         "variables (read raw, as vLLM reads its own); get_env_vars_to_copy and validate_environ "
         "read the registry at call time, so every worker started after register() sees it."),
    upstream=("None: vLLM has no way for a plugin to declare its environment variables; "
              "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY (0.14.0+) does it by hand for Ray."),
    remove_when=("vLLM lets plugins declare environment variables (then declare them there), "
                 "or finding 'plugin_env_listed' is true on every supported release."),
),), ("plugin_env_listed",), probe)
