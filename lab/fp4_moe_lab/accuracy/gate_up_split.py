# SPDX-License-Identifier: Apache-2.0
"""Write a LABELLED checkpoint whose experts' gate and up have their own weight global scales, as
published GLM NVFP4 exports have them (vllm #54974: 69 % of the pairs unequal, up to 10x).

Why: the trained model's real-quantizer checkpoints give gate and up one scale (ModelOpt 0.47.0
and llmcompressor 0.14 unify them; ``vllm-fp4-moe audit`` finds no split), so the hole vLLM has
for such exports (every release keeps the gate's scale for both halves) cannot show on them.

The edit keeps the model: for each expert a factor ``f`` (powers of two, exact in fp32, both
directions: ``FACTORS`` by expert index), its up_proj scaled by ``f`` and its down_proj by
``1 / f``, which computes the same function; written as a split-scale export writes it, the FP4
codes and block scales unchanged and only the per-tensor scales moved: up_proj's weight global
scale times ``f``, down_proj's over ``f``, and down_proj's activation scale times ``f`` (the
calibrated amax of an input ``f`` times larger). In an ideal NVFP4 kernel every code is then the
source's, so the model answers exactly as the source checkpoint does; stock vLLM reads each up
half ``f`` times off. ModelOpt stores dequantizing scales (``weight_scale_2``, ``input_scale``),
compressed-tensors their inverses (``*_global_scale``).

Not committed (megabytes of near-copies; the repository must stay under the device tool's 64 MiB
working-tree limit): :func:`ensure` writes ``models/SRC-gate-up-split/`` when it is missing or
not the bytes the table was measured on (``OUTPUT_SHA256``). Standard library only. Writes
``split-log.json`` (source checksum, factors, every edit) next to the weights.

Usage: python accuracy/gate_up_split.py [--src DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fp4_moe_lab.accuracy.scalar_edits import rewrite_scalars, sha256
from fp4_moe_lab.checkout import ROOT

HERE = ROOT / "accuracy"  # the models live there
SRC = HERE / "models" / "qwen3moe-add-nvfp4-modelopt"
# up/gate weight-scale ratio by expert index (cycled): equal, 2x, a quarter, 8x
FACTORS = (1.0, 2.0, 0.25, 8.0)
KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(up|down)_proj\."
                 r"(weight_scale_2|input_scale|weight_global_scale|input_global_scale)$")
# (projection, tensor) -> the power of f it is multiplied by
EDIT = {("up", "weight_scale_2"): 1, ("down", "weight_scale_2"): -1, ("down", "input_scale"): 1,
        ("up", "weight_global_scale"): -1, ("down", "weight_global_scale"): 1,
        ("down", "input_global_scale"): -1}

# the labelled edits the accuracy table uses: source dir -> model.safetensors sha256 (the second
# on top of the EP-skew edit, accuracy/skew.py: CI's slice guards both holes with one checkpoint)
OUTPUT_SHA256: dict[str, str] = {
    "qwen3moe-add-nvfp4-modelopt":
        "47f6aaf7b97bafc1477948a11e51931e6212195b8e46c9d524d18a0029e234c3",
    "qwen3moe-add-nvfp4-ct-all-ep-skew4":
        "bf134379e4a847a485380088165d171e09754a7cb46feb8d1d3750133b5236bb",
}


def default_out(src: Path = SRC) -> Path:
    return src.parent / f"{src.name}-gate-up-split"


def ensure(src_name: str) -> Path:
    """models/SRC-gate-up-split/ of the table, written if missing or not the recorded bytes."""
    src, want = HERE / "models" / src_name, OUTPUT_SHA256[src_name]
    out = default_out(src)
    st = out / "model.safetensors"
    if not (st.is_file() and (out / "split-log.json").is_file() and sha256(st) == want):
        split(src, out)
        got = sha256(st)
        if got != want:
            raise RuntimeError(f"{out}: wrote sha256 {got}, the table was measured on "
                               f"{want}: is {src} changed?")
    return out


def _shown(path: Path) -> str:
    """A path as the log names it: from the repository root where it is inside."""
    return str(path.relative_to(HERE.parent)) if path.is_relative_to(HERE.parent) else str(path)


def factor(expert: int) -> float:
    return FACTORS[expert % len(FACTORS)]


def split(src: Path, out: Path) -> dict:
    src = src.resolve()

    def new_value(key):
        m = KEY.match(key)
        if not m or (m[3], m[4]) not in EDIT or factor(int(m[2])) == 1.0:
            return None
        return lambda old: old * factor(int(m[2])) ** EDIT[m[3], m[4]]

    edits = rewrite_scalars(src, out, new_value)
    if not edits:
        raise SystemExit(f"{src}: no expert up/down_proj scale to edit")
    log = {
        "label": "EDITED: each expert's up_proj scaled by f and down_proj by 1/f (the same "
                 "model), stored as a split gate/up export stores it: up's weight global scale "
                 "f x the gate's; not a quantizer's output",
        "source": _shown(src),
        "source_sha256": sha256(src / "model.safetensors"),
        "factors_by_expert_index": list(FACTORS), "edits": edits,
        "command": "python accuracy/gate_up_split.py"
                   + ("" if src.resolve() == SRC.resolve() else f" --src {_shown(src)}"),
    }
    (out / "split-log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", type=Path, default=SRC)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or default_out(a.src)
    log = split(a.src, out)
    print(f"{len(log['edits'])} scales edited -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
