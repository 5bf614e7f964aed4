# SPDX-License-Identifier: Apache-2.0
"""Write a LABELLED checkpoint in which one expert of every MoE layer has a dead activation scale
of one value class, as the field reports them (docs/SUPPORT.md, "Field reports").

Why: the trained model's real-quantizer checkpoints hold one natural uncalibrated expert
(ct-routed's -6.8e-23); the reports show more forms, and each is a row of the accuracy table:

* ``missing``: the expert's gate/up/down activation-scale tensors are absent (vllm #45212:
  ModelOpt exports omit the ``input_scale`` of experts no calibration token reached);
* ``nan``: NaN (llm-compressor #2826/#2827: the all-experts default was never wired);
* ``inf``: +inf (compressed-tensors #595: 14 of 92,400 in a Qwen3.5-397B export);
* ``denormal``: 1e-40 (vllm #42601);
* ``zero``: 0.0 (llmcompressor's down_proj value for an expert without statistics; ModelOpt's
  zero amax);
* ``negative``: -127.6 (llmcompressor's uninitialised memory, measured here).

The edit: expert ``EXPERT`` of every MoE layer gets the value in all three of its activation
scales (compressed-tensors ``input_global_scale``, ModelOpt ``input_scale``), or loses them;
nothing else changes (weights, weight scales, other experts, router, tokenizer: byte-identical).
The ideal column serves it with the plugin on and the reference kernel, i.e. the expert at the
calibrated experts' max amax (ModelOpt's exporter rule), so the task stays solvable.

Not committed (megabytes of near-copies; the repository must stay under the device tool's 64 MiB
working-tree limit): :func:`ensure` writes ``models/SRC-dead-CASE/`` when it is missing or not
the bytes the table was measured on (``OUTPUT_SHA256``). Standard library only. Writes
``dead-log.json`` (source checksum, case, every edit) next to the weights.

Usage: python accuracy/dead_scale.py CASE [--src DIR] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from pathlib import Path

from fp4_moe_lab.accuracy.experts_only import read_header
from fp4_moe_lab.accuracy.scalar_edits import sha256
from fp4_moe_lab.checkout import ROOT

HERE = ROOT / "accuracy"  # the models live there

EXPERT = 5  # EP rank 1's second expert of 8 (rank 0's under DP=2+EP sees it only by dispatch)
CASES = {"missing": None, "nan": float("nan"), "inf": float("inf"), "denormal": 1e-40,
         "zero": 0.0, "negative": -127.6}
KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\."
                 r"(input_global_scale|input_scale)$")

# the labelled edits the accuracy table uses, (source dir, case) -> model.safetensors sha256
OUTPUT_SHA256: dict[tuple[str, str], str] = {
    ("qwen3moe-add-nvfp4-modelopt", "missing"):
        "1e9a5075f6fe1fb6cb3a310755fe8670ef0b31daa523cb0201f1447cea071bf0",
    ("qwen3moe-add-nvfp4-ct-all", "nan"):
        "ca6532c10d8da236ea8ac62d63dfc07242ba3558c4077f1c1e077a5b13281460",
    ("qwen3moe-add-nvfp4-ct-all", "inf"):
        "0fb52e463e9edc65216f8d5ca190eeee1c93bd1fbce814ad0dfd97dcc55e66c6",
    ("qwen3moe-add-nvfp4-ct-all", "denormal"):
        "ae806ac8065f148e247ca2f3decafd360403b2be140a8a77ff3d64103e1f3fd7",
    ("qwen3moe-add-nvfp4-ct-all", "zero"):
        "375e1fd9573b8aecab0d927c1e4555dfd76e21f56b14cec16eaf198df24bf221",
    ("qwen3moe-add-nvfp4-ct-all", "negative"):
        "aef590319e80135fe6f94bb5850159fb6bec21ce41b21589bbd1123ee0307d3e",
}


def default_out(src: Path, case: str) -> Path:
    return src.parent / f"{src.name}-dead-{case}"


def ensure(src_name: str, case: str) -> Path:
    """models/SRC-dead-CASE/ of the table, written if missing or not the recorded bytes."""
    src = HERE / "models" / src_name
    out = default_out(src, case)
    st, want = out / "model.safetensors", OUTPUT_SHA256.get((src_name, case))
    if not (st.is_file() and (out / "dead-log.json").is_file()
            and (want is None or sha256(st) == want)):
        dead(src, out, case)
    if want is not None and sha256(st) != want:
        raise RuntimeError(f"{out}: wrote sha256 {sha256(st)}, the table was measured on {want}: "
                           f"is {src} changed?")
    return out


def dead(src: Path, out: Path, case: str) -> dict:
    src, out = src.resolve(), out.resolve()
    if case not in CASES:
        raise SystemExit(f"CASE must be one of {', '.join(CASES)} (got {case!r})")
    header, base = read_header(src / "model.safetensors")
    data = (src / "model.safetensors").read_bytes()
    hit = sorted(k for k in header if (m := KEY.match(k)) and int(m[2]) == EXPERT)
    if not hit:
        raise SystemExit(f"{src}: no activation scale of expert {EXPERT} in any MoE layer")
    edits, kept = [], {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        b, e = (base + o for o in meta["data_offsets"])
        blob = data[b:e]
        if name in hit:
            if meta["dtype"] != "F32" or meta["shape"] not in ([1], []):
                raise SystemExit(f"{name}: expected one F32 scalar, found {meta['dtype']} "
                                 f"{meta['shape']}")
            (old,) = struct.unpack("<f", blob)
            if CASES[case] is None:
                edits.append({"tensor": name, "old": old, "new": "absent"})
                continue
            blob = struct.pack("<f", CASES[case])
            edits.append({"tensor": name, "old": old, "new": repr(CASES[case])})
        kept[name] = (meta, blob)
    out_header = {"__metadata__": header.get("__metadata__", {"format": "pt"})}
    pos, parts = 0, []
    for name in sorted(kept):
        meta, blob = kept[name]
        out_header[name] = {"dtype": meta["dtype"], "shape": meta["shape"],
                            "data_offsets": [pos, pos + len(blob)]}
        parts.append(blob)
        pos += len(blob)
    raw = json.dumps(out_header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors: the data starts 8-byte aligned
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in ("model.safetensors", "skew-log.json"):
            shutil.copy2(f, out / f.name)
    (out / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(parts))
    log = {
        "label": f"EDITED: expert {EXPERT}'s activation scales in every MoE layer "
                 + ("removed" if CASES[case] is None else f"set to {CASES[case]!r}")
                 + f" ({case}); not a quantizer's output",
        "source": str(src.relative_to(HERE.parent)),
        "source_sha256": sha256(src / "model.safetensors"),
        "case": case, "expert": EXPERT, "edits": edits,
        "command": f"python accuracy/dead_scale.py {case} --src {src.relative_to(HERE.parent)}",
    }
    (out / "dead-log.json").write_text(json.dumps(log, indent=1) + "\n")
    return log


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", choices=sorted(CASES))
    ap.add_argument("--src", type=Path, default=HERE / "models" / "qwen3moe-add-nvfp4-ct-all")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    log = dead(a.src, a.out or default_out(a.src, a.case), a.case)
    print(f"{len(log['edits'])} scales edited -> {a.out or default_out(a.src, a.case)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
