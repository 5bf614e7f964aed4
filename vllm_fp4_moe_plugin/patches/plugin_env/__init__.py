# SPDX-License-Identifier: Apache-2.0
"""The slice of the ledger for every design: vLLM learns the plugin's environment variables
(why: the entry below). vLLM-free. ``register()`` applies it in every process when the switch is
on, before vLLM starts any worker; the MoE patches come later, when vLLM imports its NVFP4 MoE
modules.
"""

from __future__ import annotations

import os

from vllm_fp4_moe_plugin import envs
from vllm_fp4_moe_plugin import vllm_modules as vm
from vllm_fp4_moe_plugin.patching import ModulePatch

DESIGN = None  # every MoE design: this is about how vLLM starts processes, not about MoE


def _reader(name: str):
    def read():  # the raw string, as vLLM's own readers return it: the plugin parses it
        return os.environ.get(name)
    return read


def _build_registry(original: dict) -> dict:
    return {**original, **{n: _reader(n) for n in envs.environment_variables
                            if n not in original}}


def _unlisted(findings) -> bool:
    """vLLM's registry of environment variables does not list the plugin's (every release so
    far: compat.plugin_env_listed)."""
    return not findings["plugin_env_listed"]


LEDGER: tuple[ModulePatch, ...] = (ModulePatch(
    module=vm.VLLM_ENVS, attr="environment_variables", build=_build_registry, design=DESIGN,
    needed=_unlisted,
    why=("vLLM copies to Ray workers and Ray data-parallel engine cores only the variables its "
         "registry lists up to 0.13.x (v0110 vllm/ray/ray_env.py:52-58; 0.14.0+ also copies "
         "every VLLM_-prefixed one): with the Ray executor the driver logs the plugin active "
         "while workers on other nodes run stock vLLM. vLLM 0.2x+ logs 'Unknown vLLM "
         "environment variable detected' for each unlisted VLLM_ variable, and refuses to "
         "start with --fail-on-environ-validation (v0.32.0 vllm/platforms/interface.py:"
         "1446-1459)."),
    how=("Rebinds vllm.envs.environment_variables to a copy that also lists the plugin's "
         "variables (read raw, as vLLM reads its own); get_env_vars_to_copy and validate_environ "
         "read the registry at call time, so every worker started after register() sees it."),
    upstream=("None: vLLM has no way for a plugin to declare its environment variables; "
              "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY (0.14.0+) does it by hand for Ray."),
    remove_when=("vLLM lets plugins declare environment variables (then declare them there), "
                 "or compat finding 'plugin_env_listed' is true on every supported release."),
),)
