# SPDX-License-Identifier: Apache-2.0
"""Which safetensors file holds each tensor of a checkpoint directory, without reading tensors.

Shared by the audit (which must touch only scale tensors) and the loading checks. Resolution
follows vLLM 0.11.0's loader: ``model.safetensors.index.json`` when present
(weight_utils.py ``filter_duplicate_safetensors_files``), else every ``*.safetensors`` file.
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be read as intended; the message names the file,
    tensor or layer at fault and what to fix."""


class CheckpointAuditError(CheckpointError):
    """The checkpoint cannot be audited; the message names the file, tensor or layer and the
    fix."""


def read_json(path: Path, *, what: str) -> dict:
    """Parse a JSON object file; errors name the file and the position of a syntax error."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing {what}") from None
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}: {what} is not UTF-8 text; re-export the file") from None
    except OSError as exc:  # a directory, no permission, an I/O error
        raise CheckpointError(f"{path}: cannot read {what} ({exc.strerror or exc}); fix the "
                              "file or its permissions") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: invalid JSON in {what} at line {exc.lineno} column "
                              f"{exc.colno}: {exc.msg}; fix or re-export the file") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path}: {what} must be a JSON object, got {type(obj).__name__}")
    return obj


def checkpoint_dir(path) -> Path:
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint directory {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"{p} is not a directory; pass the checkpoint directory (the one "
                              "holding config.json)")
    return p


def tensor_files(path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` from the index, or from the files' headers."""
    root = checkpoint_dir(path)
    index = root / INDEX_NAME
    if index.exists():
        weight_map = read_json(index, what="safetensors index").get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to "
                                  "shard files; regenerate the index")
        shards = {file: root / file for file in set(weight_map.values())}  # one Path per shard
        return {name: shards[file] for name, file in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{root}: no *.safetensors files and no {INDEX_NAME}")
    out: dict[str, Path] = {}
    for f in files:
        with open_safetensors(f) as handle:  # header only
            out.update({name: f for name in handle.keys()})  # noqa: SIM118
    return out


def open_safetensors(f: Path, framework: str = "np"):
    """``safe_open`` whose errors name the file: a truncated, empty or unreadable file is a
    :class:`CheckpointError` (safetensors' own error does not say which file)."""
    try:
        return safe_open(str(f), framework=framework)
    except Exception as exc:  # SafetensorError, OSError (directory, permissions), ...
        raise CheckpointError(
            f"{f}: not a readable safetensors file ({type(exc).__name__}: {exc}); the file is "
            "truncated, empty or unreadable -- copy or download it again") from None
