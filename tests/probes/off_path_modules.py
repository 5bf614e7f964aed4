# SPDX-License-Identifier: Apache-2.0
"""A vLLM process with the plugin installed and the switch as the environment sets it: vLLM's
plugin loader calls register(), vLLM imports its parallel state (the fleet check's trigger is
installed), then builds its world group at world size 1 over gloo (the trigger runs). Prints
``STAGES {json}``: the plugin's modules loaded after each step; under ``-X importtime`` it also
marks each step's end on stderr (``STEP name``), between the interpreter's import lines. Run by
tests/plugin/test_off_path_imports.py."""

import json
import socket
import sys

from vllm.plugins import load_general_plugins


def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "vllm_fp4_moe_plugin")


def step(name):
    stages[name] = loaded()
    print(f"STEP {name}", file=sys.stderr, flush=True)


stages = {}
load_general_plugins()  # vLLM's own loader calls register(), as in every vLLM process
step("register")
import vllm.distributed.parallel_state as ps  # noqa: E402  (the fleet trigger's module)

step("parallel_state")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config  # noqa: E402

with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    ps.init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
step("rendezvous")
import vllm_fp4_moe_plugin as plugin  # noqa: E402

print("STAGES " + json.dumps({"state": list(plugin.state()), "stages": stages}))
