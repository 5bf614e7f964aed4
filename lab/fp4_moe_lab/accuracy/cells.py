# SPDX-License-Identifier: Apache-2.0
"""What the accuracy table is made of: its checkpoints, layouts, worlds and columns, the key of
each cell, where the table's JSON and documents live, and reading a failed cell's reason.
Shared by the runner (:mod:`.table`) and the report (:mod:`.report`)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fp4_moe_lab.checkout import ROOT as REPO

MODELS = REPO / "accuracy" / "models"
BF16 = "qwen3moe-add-bf16"
# checkpoint directory prefix -> the bf16 model it was quantized from (one per trained model)
BF16_OF_PREFIX = {"qwen3moe-add-": BF16, "deepseekv3-add-": "deepseekv3-add-bf16"}
TASK_DIR = REPO / "accuracy" / "lm_eval_task"
TASK = "addition3"
JSON_OUT = REPO / "docs" / "data" / "accuracy.json"
MD_OUT = REPO / "docs" / "ACCURACY.md"
PNG_OUT = REPO / "docs" / "data" / "accuracy.png"
COLUMNS = ("bf16", "ideal", "stock", "plugin")
# checkpoint directory -> (short name, format); the first that exists is the headline
CHECKPOINTS = {
    "qwen3moe-add-nvfp4-ct-routed": ("ct-routed", "compressed-tensors"),
    "qwen3moe-add-nvfp4-ct-all": ("ct-all", "compressed-tensors"),
    "qwen3moe-add-nvfp4-modelopt": ("modelopt", "modelopt"),
    "qwen3moe-add-nvfp4-ct-routed-dead": ("ct-routed-dead", "compressed-tensors"),
    # LABELLED edits of ct-all (accuracy/skew.py): EP=2 GEMM1 slice-max ratio 1.5 and 4, to show
    # the newest releases' DP+EP mechanism that no natural checkpoint here has
    "qwen3moe-add-nvfp4-ct-all-ep-skew1.5": ("ct-all-ep-skew1.5", "compressed-tensors"),
    "qwen3moe-add-nvfp4-ct-all-ep-skew4": ("ct-all-ep-skew4", "compressed-tensors"),
    # the DeepSeek-V3 architecture (accuracy/train.py --arch deepseek_v3), routed experts NVFP4;
    # routed calibration only: its all-experts checkpoint is not committed (accuracy/README.md)
    "deepseekv3-add-nvfp4-ct-routed": ("dsv3-ct-routed", "compressed-tensors"),
    "deepseekv3-add-nvfp4-ct-routed-ep-skew4": ("dsv3-ct-routed-ep-skew4", "compressed-tensors"),
    # LABELLED dead-scale edits (accuracy/dead_scale.py): expert 5 of every MoE layer with a
    # value class the field reports (docs/SUPPORT.md): absent from a ModelOpt export, or NaN,
    # +inf, denormal, 0, negative in a compressed-tensors one
    "qwen3moe-add-nvfp4-modelopt-dead-missing": ("modelopt-dead-missing", "modelopt"),
    # LABELLED split gate/up edits (accuracy/gate_up_split.py): the same model, each expert's up
    # weight global scale 1, 2, 1/4 or 8 x the gate's, as published GLM exports store theirs;
    # the second on the EP-skew edit (CI's slice: both holes in one checkpoint)
    "qwen3moe-add-nvfp4-modelopt-gate-up-split": ("modelopt-gate-up-split", "modelopt"),
    "qwen3moe-add-nvfp4-ct-all-ep-skew4-gate-up-split": ("ct-all-ep-skew4-gate-up-split",
                                                          "compressed-tensors"),
    **{f"qwen3moe-add-nvfp4-ct-all-dead-{c}": (f"ct-all-dead-{c}", "compressed-tensors")
       for c in ("nan", "inf", "denormal", "zero", "negative")},
}


GATE_UP_SPLIT_SUFFIX = "-gate-up-split"  # accuracy/gate_up_split.py's output directories


def bf16_of(ckpt_dir: str) -> str:
    """The unquantized model a checkpoint directory was made from."""
    return next(b for prefix, b in BF16_OF_PREFIX.items() if ckpt_dir.startswith(prefix))


# layout name -> (tp, dp, ep); per world, in the order they are run
LAYOUTS = {
    "single": (1, 1, False),
    "tp2ep": (2, 1, True),
    "dp2ep": (1, 2, True),
    "dp2": (1, 2, False),
}
WORLD_LAYOUTS = {"0.11.0": ("single", "tp2ep"), "0.32.0": ("single", "tp2ep", "dp2ep", "dp2"),
                 "0.32.0-patched": ("dp2ep",)}
# most informative first: the newest releases' hole, then 0.11.0's, then the rest; last the
# same hole in 0.32.0 with upstream/'s patches (stock there must answer as the plugin does)
PRIORITY = [("0.32.0", "dp2ep"), ("0.11.0", "single"), ("0.11.0", "tp2ep"),
            ("0.32.0", "single"), ("0.32.0", "tp2ep"), ("0.32.0", "dp2"),
            ("0.32.0-patched", "dp2ep")]


def cell_key(world: str, layout: str, ckpt: str, column: str) -> str:
    """ckpt: the short name. The bf16 cell is shared by every checkpoint of one trained model
    (the Qwen3-MoE's keeps its original key, ``WORLD|LAYOUT|bf16``)."""
    if column != "bf16":
        return f"{world}|{layout}|{ckpt}|{column}"
    bf = bf16_of(dir_of(ckpt))
    return f"{world}|{layout}|bf16" + ("" if bf == BF16 else f"@{bf}")


def dir_of(name: str) -> str:
    return next(d for d, (n, _fmt) in CHECKPOINTS.items() if n == name)


def present_checkpoints() -> list[tuple[str, str, str]]:
    return [(d, name, fmt) for d, (name, fmt) in CHECKPOINTS.items() if (MODELS / d).is_dir()]


def failure_reason(text: str) -> str:
    """The most telling line of a failed cell: the plugin's own refusal if there is one."""
    text = "\n".join(ln for ln in text.splitlines() if "ulimit" not in ln)
    for pat in (r"(InvalidScaleError|UncalibratedScaleError|InconsistentMoELayerError): "
                r"([^\n]{0,120})",
                r"(\w+Error): ((?!Engine core initialization failed)[^\n]{0,120})"):
        m = re.search(pat, text)
        if m:
            return f"{m.group(1)}: {m.group(2)}"
    return text.strip().splitlines()[-1][:120] if text.strip() else "failed"


def scales_info(ckpt_dir: str) -> dict:
    """Per layer, from accuracy/models/SCALES.json: GEMM1 (w13) input-scale spread and the EP=2
    slice-max ratio (rank 1 / rank 0) and the factor stock DP=2+EP is off by."""
    path = MODELS / "SCALES.json"
    if not path.exists():
        return {}
    # a split gate/up edit leaves every activation scale of GEMM1 as its source has it
    data = json.loads(path.read_text()).get(ckpt_dir.removesuffix(GATE_UP_SPLIT_SUFFIX))
    if not data:
        return {}
    out = {}
    for layer, d in data.get("layers", {}).items():
        w13 = d.get("w13", {})
        out[layer] = {k: w13.get(k) for k in ("spread", "ep2_slice_max_amax",
                                              "ep2_ratio_rank1_over_rank0", "ep2_error_factor",
                                              "uncalibrated_experts")}
    return out


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"cells": {}}


def save(data: dict, path: Path) -> None:
    data["task"] = {"lm_eval_task": str(TASK_DIR.relative_to(REPO)), "name": TASK,
                    "metric": "exact_match", "interval": "95 % Wilson score"}
    data["checkpoints"] = {name: {"dir": f"accuracy/models/{d}", "format": fmt,
                                  "scales": scales_info(d)}
                           for d, (name, fmt) in CHECKPOINTS.items() if (MODELS / d).is_dir()}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
