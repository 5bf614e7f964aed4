"""Write a LABELLED checkpoint whose EP=2 GEMM1 slice maxima differ by a chosen factor.

Why: every checkpoint the real quantizers wrote for the trained model has an EP=2 GEMM1
slice-max ratio of exactly 1 (models/SCALES.md: all-experts calibration gives every expert the
same gate/up scale; routed calibration put the layer's largest amax on both ranks), so the
newest releases' DP+EP hole (each rank collapses GEMM1's activation scale to the max over its
own experts, the sender quantizes with its scale, the receiver dequantizes with its own) cannot
show on them. Issue 18 asks for the natural checkpoint as the headline and allows a second,
labelled one that shows the mechanism. This is it:

* source: ``models/qwen3moe-add-nvfp4-ct-all`` (llmcompressor's default calibration; every
  expert's gate/up ``input_global_scale`` is the same);
* edit: the gate_proj and up_proj ``input_global_scale`` of experts 4-7 (EP rank 1 of 2) in
  every MoE layer divided by FACTOR, i.e. their calibrated amax taken FACTOR times larger;
  nothing else changes (weights, weight scales, down_proj, router, tokenizer: byte-identical);
* the model stays correct for a kernel that uses each expert's own scale (the ideal column):
  a larger amax only coarsens that expert's FP8 block-scale grid; it is what a routed
  calibration would write if experts 4-7 had seen activations FACTOR times larger.

Under stock vLLM 0.14.0-0.34.0 at DP=2+EP, tokens crossing ranks are then off by FACTOR; on
stock 0.11.0 (expert 0's scale for every expert) tokens routed to experts 4-7 are too.
Standard library only (F32 scalars in safetensors: JSON header + raw little-endian bytes).
Writes ``skew-log.json`` (source checksum, factor, every edited value) next to the weights.

Not committed (they would be 7.6 MB of copies of ct-all, and the repository must stay under the
device tool's 64 MiB working-tree limit): ``ensure(factor)`` writes ``models/...-ep-skewF/``
when it is missing or stale, and checks the result against ``OUTPUT_SHA256``, the bytes the
published table was measured on. accuracy/run_table.py and the CI slice call it.

Usage: python accuracy/skew.py FACTOR [--src DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import struct
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from accuracy.experts_only import read_header  # noqa: E402

SRC = HERE / "models" / "qwen3moe-add-nvfp4-ct-all"
RANK1_EXPERTS = (4, 5, 6, 7)
KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up)_proj\.input_global_scale$")


# the labelled edits the accuracy table uses, and the model.safetensors each must come out as
OUTPUT_SHA256 = {
    1.5: "af99f2faaa527b24b3bff06ed88f6779083a82c0921f35aa070dc9c5dd7fdffe",
    4.0: "7c87b50acd99ce1f87ca71259de160ae7078694ae7530145aaae7d31addd6285",
}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure(factor: float) -> Path:
    """models/...-ep-skewF/ of the table, written if missing or not the recorded bytes."""
    out = default_out(factor)
    st = out / "model.safetensors"
    if not (st.is_file() and (out / "skew-log.json").is_file() and sha256(st) == OUTPUT_SHA256[factor]):
        skew(SRC, out, factor)
        got = sha256(st)
        if got != OUTPUT_SHA256[factor]:
            raise RuntimeError(f"{out}: wrote sha256 {got}, the table was measured on "
                               f"{OUTPUT_SHA256[factor]}: is {SRC} changed?")
    return out


def default_out(factor: float) -> Path:
    return HERE / "models" / f"qwen3moe-add-nvfp4-ct-all-ep-skew{factor:g}"


def skew(src: Path, out: Path, factor: float) -> dict:
    if not factor > 1.0:
        raise SystemExit(f"FACTOR must be > 1 (got {factor})")
    data = bytearray((src / "model.safetensors").read_bytes())
    header, base = read_header(src / "model.safetensors")
    edits = []
    for key, meta in sorted(header.items()):
        m = KEY.match(key)
        if not m or int(m[2]) not in RANK1_EXPERTS:
            continue
        if meta["dtype"] != "F32" or meta["shape"] not in ([1], []):
            raise SystemExit(f"{key}: expected one F32 scalar, found {meta['dtype']} {meta['shape']}")
        begin = base + meta["data_offsets"][0]
        (old,) = struct.unpack_from("<f", data, begin)
        struct.pack_into("<f", data, begin, old / factor)
        (new,) = struct.unpack_from("<f", data, begin)
        edits.append({"tensor": key, "old": old, "new": new})
    if not edits:
        raise SystemExit(f"{src}: no gate/up input_global_scale of experts {RANK1_EXPERTS}")
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, out / f.name)
    (out / "model.safetensors").write_bytes(bytes(data))
    log = {
        "label": f"EDITED: experts 4-7's gate/up input_global_scale / {factor:g} "
                 "(EP=2 GEMM1 slice-max ratio = factor); not a quantizer's output",
        "source": str(src.relative_to(HERE.parent)),
        "source_sha256": sha256(src / "model.safetensors"),
        "factor": factor, "experts": list(RANK1_EXPERTS), "edits": edits,
        "command": f"python accuracy/skew.py {factor:g}",
    }
    (out / "skew-log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("factor", type=float)
    ap.add_argument("--src", type=Path, default=SRC)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    log = skew(a.src, a.out or default_out(a.factor), a.factor)
    print(f"{len(log['edits'])} scales edited -> {a.out or default_out(a.factor)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
