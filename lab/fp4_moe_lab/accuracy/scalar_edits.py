# SPDX-License-Identifier: Apache-2.0
"""What the labelled checkpoint edits share (accuracy/skew.py, accuracy/gate_up_split.py): a copy
of a checkpoint with some of its F32 scalar tensors rewritten in place, every other byte and file
as the source has them. Standard library only."""

from __future__ import annotations

import hashlib
import shutil
import struct
from pathlib import Path
from typing import Callable, Optional

from fp4_moe_lab.accuracy.experts_only import read_header


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite_scalars(src: Path, out: Path,
                    new_value: Callable[[str], Optional[Callable[[float], float]]]) -> list[dict]:
    """``out``: ``src`` with each F32 scalar ``key`` for which ``new_value(key)`` gives a function
    rewritten to ``function(old)``; the edits (tensor, old, new as stored). Nothing is written
    when no tensor is picked."""
    data = bytearray((src / "model.safetensors").read_bytes())
    header, base = read_header(src / "model.safetensors")
    edits = []
    for key, meta in sorted(header.items()):
        rewrite = new_value(key) if key != "__metadata__" else None
        if rewrite is None:
            continue
        if meta["dtype"] != "F32" or meta["shape"] not in ([1], []):
            raise SystemExit(f"{key}: expected one F32 scalar, "
                             f"found {meta['dtype']} {meta['shape']}")
        begin = base + meta["data_offsets"][0]
        (old,) = struct.unpack_from("<f", data, begin)
        struct.pack_into("<f", data, begin, rewrite(old))
        (new,) = struct.unpack_from("<f", data, begin)
        edits.append({"tensor": key, "old": old, "new": new})
    if edits:
        out.mkdir(parents=True, exist_ok=True)
        for f in sorted(src.iterdir()):
            if f.is_file() and f.name != "model.safetensors":
                shutil.copy2(f, out / f.name)
        (out / "model.safetensors").write_bytes(bytes(data))
    return edits
