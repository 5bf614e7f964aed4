# SPDX-License-Identifier: Apache-2.0
"""Write a LABELLED checkpoint whose EP=2 GEMM1 slice maxima differ by a chosen factor.

Why: every checkpoint the real quantizers wrote for the trained model has an EP=2 GEMM1
slice-max ratio of exactly 1 (models/SCALES.md: all-experts calibration gives every expert the
same gate/up scale; routed calibration put the layer's largest amax on both ranks), so the
newest releases' DP+EP hole (each rank collapses GEMM1's activation scale to the max over its
own experts, the sender quantizes with its scale, the receiver dequantizes with its own) cannot
show on them. The natural checkpoint is the table's headline; a second,
labelled one that shows the mechanism. This is it:

* source: ``models/qwen3moe-add-nvfp4-ct-all`` (llmcompressor's default calibration; every
  expert's gate/up ``input_global_scale`` is the same), or with ``--src`` another
  compressed-tensors checkpoint (the table also uses the DeepSeek-V3 ``ct-routed`` one);
* edit: the gate_proj and up_proj ``input_global_scale`` of the second half of the experts
  (EP rank 1 of 2: 4-7 of 8, 8-15 of 16) in every MoE layer divided by FACTOR, i.e. their
  calibrated amax taken FACTOR times larger;
  nothing else changes (weights, weight scales, down_proj, router, tokenizer: byte-identical);
* the model stays correct for a kernel that uses each expert's own scale (the ideal column):
  a larger amax only coarsens that expert's FP8 block-scale grid; it is what a routed
  calibration would write if experts 4-7 had seen activations FACTOR times larger.

Under stock vLLM 0.14.0-0.34.0 at DP=2+EP, tokens crossing ranks are then off by FACTOR; on
stock 0.11.0 (expert 0's scale for every expert) tokens routed to rank 1's experts are too.
Standard library only (F32 scalars in safetensors: JSON header + raw little-endian bytes).
Writes ``skew-log.json`` (source checksum, factor, every edited value) next to the weights.

Not committed (they would be megabytes of near-copies of their source, and the repository must stay
under the device tool's 64 MiB working-tree limit): ``ensure(src, factor)`` writes
``models/SRC-ep-skewF/``
when it is missing or stale, and checks the result against ``OUTPUT_SHA256``, the bytes the
published table was measured on. accuracy/run_table.py and the CI slice call it.

Usage: python accuracy/skew.py FACTOR [--src DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from fp4_moe_lab.accuracy.experts_only import read_header
from fp4_moe_lab.accuracy.scalar_edits import rewrite_scalars, sha256
from fp4_moe_lab.checkout import ROOT

HERE = ROOT / "accuracy"  # the models live there

SRC = HERE / "models" / "qwen3moe-add-nvfp4-ct-all"
KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up)_proj\.input_global_scale$")


# the labelled edits the accuracy table uses, (source dir, factor) -> the model.safetensors
# each must come out as
OUTPUT_SHA256 = {
    ("qwen3moe-add-nvfp4-ct-all", 1.5):
        "af99f2faaa527b24b3bff06ed88f6779083a82c0921f35aa070dc9c5dd7fdffe",
    ("qwen3moe-add-nvfp4-ct-all", 4.0):
        "7c87b50acd99ce1f87ca71259de160ae7078694ae7530145aaae7d31addd6285",
    ("deepseekv3-add-nvfp4-ct-routed", 4.0):
        "e178ebd0ead2af2c3d360ff8362d7e0af7dd13939c6bf9222df248477430e9e5",
}


def ensure(src_name: str, factor: float) -> Path:
    """models/SRC-ep-skewF/ of the table, written if missing or not the recorded bytes."""
    src, want = HERE / "models" / src_name, OUTPUT_SHA256[(src_name, factor)]
    out = default_out(factor, src)
    st = out / "model.safetensors"
    if not (st.is_file() and (out / "skew-log.json").is_file() and sha256(st) == want):
        skew(src, out, factor)
        got = sha256(st)
        if got != want:
            raise RuntimeError(f"{out}: wrote sha256 {got}, the table was measured on "
                               f"{want}: is {src} changed?")
    return out


def default_out(factor: float, src: Path = SRC) -> Path:
    return src.parent / f"{src.name}-ep-skew{factor:g}"


def skew(src: Path, out: Path, factor: float) -> dict:
    if not factor > 1.0:
        raise SystemExit(f"FACTOR must be > 1 (got {factor})")
    header, _ = read_header(src / "model.safetensors")
    experts = sorted({int(m[2]) for m in map(KEY.match, header) if m})
    rank1 = experts[len(experts) // 2:]  # vLLM's linear placement over 2 EP ranks

    def new_value(key):
        m = KEY.match(key)
        return (lambda old: old / factor) if m and int(m[2]) in rank1 else None

    edits = rewrite_scalars(src, out, new_value)
    if not edits:
        raise SystemExit(f"{src}: no gate/up input_global_scale of rank 1's experts")
    log = {
        "label": f"EDITED: experts {rank1[0]}-{rank1[-1]}'s gate/up input_global_scale / "
                 f"{factor:g} (the EP=2 GEMM1 slice-max ratio times the factor); "
                 "not a quantizer's output",
        "source": str(src.relative_to(HERE.parent)),
        "source_sha256": sha256(src / "model.safetensors"),
        "factor": factor, "experts": rank1, "edits": edits,
        "command": f"python accuracy/skew.py {factor:g}"
                   + ("" if src.resolve() == SRC.resolve()
                      else f" --src {src.relative_to(HERE.parent)}"),
    }
    (out / "skew-log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("factor", type=float)
    ap.add_argument("--src", type=Path, default=SRC)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    out = a.out or default_out(a.factor, a.src)
    log = skew(a.src, out, a.factor)
    print(f"{len(log['edits'])} scales edited -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
