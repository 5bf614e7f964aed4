# SPDX-License-Identifier: Apache-2.0
"""Item 1: what the plugin costs every process vLLM starts, next to ``import vllm``.

Why fresh subprocesses: vLLM imports the entry point and calls ``register()`` once per process,
cold. Each probe process imports vLLM first (as vLLM's plugin loader does), then our entry-point
module, then calls ``register()``, then imports the NVFP4 MoE modules whose first import
triggers the probe and the patches (``vllm_modules.TRIGGER_MODULES``): on vLLM 0.11.0 the two
quant modules, on the NVFP4-oracle design (0.14.0+) also the oracle module (:func:`modules`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.rows import Row

_REPO = Path(__file__).resolve().parents[1]

# VLLM_FP4_MOE_PLUGIN value per mode; None = unset (the read-only watch mode).
MODES = {"on": "1", "off": "0", "unset": None}


def modules() -> list[str]:
    """The trigger modules this vLLM has, in the order vLLM imports them (0.11.0: ``modelopt``
    and ``compressed_tensors_moe``; the oracle design adds ``fused_moe/oracle/nvfp4``)."""
    from vllm_fp4_moe_plugin.base.vllm_modules import TRIGGER_MODULES

    out = []
    for name in TRIGGER_MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                out.append(name)
        except ImportError:  # a parent package this vLLM does not have
            pass
    return out


def probe(mode: str, mods: list[str]) -> dict:
    env = dict(os.environ)
    env.pop("VLLM_FP4_MOE_PLUGIN", None)
    if MODES[mode] is not None:
        env["VLLM_FP4_MOE_PLUGIN"] = MODES[mode]
    env.setdefault("TORCHDYNAMO_DISABLE", "1")
    # -m from the repository root: the root, not benchmarks/, is then on sys.path
    out = subprocess.run([sys.executable, "-m", "benchmarks.startup_probe", json.dumps(mods)],
                         env=env, capture_output=True, text=True, timeout=300, check=True,
                         cwd=_REPO)
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("BENCH"))
    return json.loads(line[len("BENCH"):])


def measure(runs: int) -> dict[str, list[dict]]:
    """``runs`` probes per mode, interleaved so drift hits every mode alike."""
    res: dict[str, list[dict]] = {m: [] for m in MODES}
    mods = modules()
    for _ in range(runs):
        for mode in MODES:
            res[mode].append(probe(mode, mods))
    return res


def _ms_median(samples: list[dict], key: str) -> float:
    return 1e3 * statistics.median(s[key] for s in samples)


def rows(runs: int) -> list[Row]:
    res = measure(runs)
    on, off, unset = res["on"], res["off"], res["unset"]
    vllm_ms = _ms_median(on + off + unset, "import_vllm")
    n = f"median of {runs} fresh processes"
    states = sorted({s["state"] for s in on})
    reg_on = _ms_median(on, "register")
    reg_unset = _ms_median(unset, "register")
    return [
        Row(1, "register(), VLLM_FP4_MOE_PLUGIN=1", "ms", reg_on, vllm_ms, "import vllm",
            "< 10 ms", reg_on < 10.0, {"note": n, "state_after_trigger": states}),
        Row(1, "register(), switch unset (watch mode)", "ms", reg_unset, vllm_ms, "import vllm",
            "< 10 ms", reg_unset < 10.0, {"note": n}),
        Row(1, "import entry point (after vllm)", "ms", _ms_median(on, "import_entry_point"),
            vllm_ms, "import vllm", "info", None, {"note": n}),
        Row(1, "probe + patch install (first quant-module import)", "ms",
            _ms_median(on, "install"), _ms_median(off, "quant_modules"),
            "that import, plugin off", "info", None,
            {"note": n + "; the hook's compat.probe() + patches.apply_all(), timed inside",
             "import_with_plugin_ms": _ms_median(on, "quant_modules")}),
    ]
