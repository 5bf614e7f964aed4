# SPDX-License-Identifier: Apache-2.0
"""Drive the engine runner (``engine_run.py`` next to this file) in ``.venv-engine`` and
compare its outputs.

The runner must execute under the CPU build of vLLM 0.11.0, a different virtualenv from the
one driving it, so it is started as a subprocess with a clean ``VLLM_*`` environment. It needs
``<checkout>/.venv-engine``. Used by tests/engine/test_engine_e2e.py and ``vllm-fp4-moe-lab demo``.
The engine runs the plugin wheel installed in ``.venv-engine``, outside the checkout.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

from fp4_moe_lab import checkout
from fp4_moe_lab.engines import plugin_wheel

RUNNER = Path(__file__).with_name("engine_run.py")
ACTIVE_LINE = "vllm-fp4-moe-plugin active"
DEFAULT_PROMPTS = [[1, 5, 9, 33, 100, 7, 250, 3], [2, 40, 41, 42, 300, 17]]


def engine_python() -> Optional[Path]:
    """``.venv-engine/bin/python`` of this checkout (``scripts/bootstrap-engine.sh``), if built."""
    candidate = checkout.ROOT / ".venv-engine" / "bin" / "python"
    return candidate if candidate.exists() else None


def run_engine(checkpoint, *, plugin: str, kernel: str = "emulator", tp: int = 1, pp: int = 1,
               prompts=DEFAULT_PROMPTS, max_tokens: int = 6, timeout_s: int = 900):
    """(per-prompt results, combined log) of one ``vllm.LLM`` run; raises with the log tail."""
    python = engine_python()
    if python is None:
        raise FileNotFoundError(
            f"{checkout.ROOT / '.venv-engine'} is missing: run "
            "./scripts/bootstrap.sh --with-engine")
    plugin_wheel.check(checkout.ROOT / ".venv-engine", "0.11.0")
    # the world's installed plugin wheel, not the checkout: no PYTHONPATH, cwd outside it
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("VLLM_") and k != "PYTHONPATH"}
    cmd = [str(python), str(RUNNER), "--checkpoint", str(Path(checkpoint).resolve()),
           "--plugin", plugin, "--kernel", kernel, "--tp", str(tp), "--pp", str(pp),
           "--prompts", json.dumps(prompts), "--max-tokens", str(max_tokens)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s,
                          cwd=tempfile.gettempdir())
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise RuntimeError(f"engine run failed ({' '.join(cmd[2:])}):\n{log[-4000:]}")
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), log


def max_logprob_gap(a: dict, b: dict) -> float:
    """Largest |logprob| difference over the tokens both runs list, step by step."""
    gap = 0.0
    for sa, sb in zip(a["logprobs"], b["logprobs"]):
        common = set(sa) & set(sb)
        gap = max([gap] + [abs(sa[t] - sb[t]) for t in common])
    return gap
