# SPDX-License-Identifier: Apache-2.0
"""``--load-format dummy`` on real vLLM layers: vLLM's own dummy loader fills the layer (random
values, about half the scales negative, no checkpoint) while its config names the format, as the
engine does around model construction. Stock serves such a model; with the plugin on it must
serve too, checking and repairing nothing (one INFO), in every layout.

There is no reference layer here (nothing was quantized), so rows compare stock and the plugin
only: both build and run, and the plugin logs no WARNING and raises nothing."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Iterable

from fp4_moe_lab.simulation.layouts import (
    LAYOUTS,
    RankContext,
    Scenario,
    spawn,
    stock_and_plugin_outputs,
)

FORMATS = ("modelopt", "compressed-tensors")


def dummy_outputs(ctx: RankContext, formats: tuple) -> list:
    """Job (inside each rank): stock and plugin on dummy weights, per format, with the plugin's
    log lines (level, message) in ``info["<fmt>/log"]``."""
    from vllm_fp4_moe_plugin.scales import unloaded

    lines: list[tuple[str, str]] = []

    class Collect(logging.Handler):
        def emit(self, record):
            lines.append((record.levelname, record.getMessage()))

    handler = Collect(level=logging.INFO)
    logger = logging.getLogger("vllm.fp4_moe_plugin")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)  # whatever level the world's vLLM logging runs at
    scenario = replace(Scenario(), load_format="dummy")
    try:
        result, index = None, 0
        for fmt in formats:
            unloaded._dummy_logged = False  # once per process: once per format here
            del lines[:]
            r = stock_and_plugin_outputs(ctx, scenario, (fmt,), ("stock", "plugin"),
                                         first_index=index)
            index += 2
            r.info[f"{fmt}/log"] = list(lines)
            result = r.merged(result)
        return result
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def run(layouts: Iterable[str], formats=FORMATS) -> dict:
    """Every rank's result per layout: ``{layout: [RankOutput, ...]}``."""
    return {name: spawn(LAYOUTS[name], f"{__name__}:dummy_outputs", tuple(formats))
            for name in layouts}
