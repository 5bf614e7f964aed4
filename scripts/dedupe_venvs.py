#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Hard-link identical files shared by this checkout's virtualenvs.

Why: the three test worlds (.venv, .venv-engine, .venv-vllm-0.12.0) each carry PyPI's CUDA
torch and its nvidia-* libraries, about 13 GiB of byte-identical files out of 30 GiB. CI once ran
out of disk building them. Linking the copies (what uv's hardlink mode does from its cache)
brings the three to about 17 GiB and changes nothing a program can see: pip replaces files by
unlink + create, never in place, so upgrading one virtualenv never touches another's files.

A file is linked to its twin only when the twin has the same path inside its virtualenv, the
same size and mode, and the same bytes. Standard library only; run with any Python 3.
Usage: dedupe_venvs.py CANONICAL OTHER [OTHER ...]
"""
from __future__ import annotations

import filecmp
import os
import stat
import sys
from pathlib import Path

MIN_BYTES = 64 * 1024  # the bulk is in large shared objects; small files are not worth a read


def _files(root: Path):
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            st = path.lstat()
            if stat.S_ISREG(st.st_mode) and st.st_size >= MIN_BYTES:
                yield path, st


def link_twins(canonical: Path, other: Path) -> tuple[int, int]:
    """Replace each file of ``other`` that equals its twin in ``canonical`` by a hard link.

    Returns (files linked, bytes freed)."""
    linked = freed = 0
    for path, st in _files(other):
        twin = canonical / path.relative_to(other)
        try:
            tst = twin.lstat()
        except FileNotFoundError:
            continue
        if (tst.st_ino == st.st_ino and tst.st_dev == st.st_dev) or not stat.S_ISREG(tst.st_mode):
            continue
        if tst.st_dev != st.st_dev or tst.st_size != st.st_size or tst.st_mode != st.st_mode:
            continue
        if not filecmp.cmp(twin, path, shallow=False):
            continue
        tmp = path.with_name(path.name + ".dedupe-tmp")
        tmp.unlink(missing_ok=True)  # left by an interrupted earlier run
        os.link(twin, tmp)
        os.replace(tmp, path)  # atomic: the name always points at a complete file
        linked += 1
        if st.st_nlink == 1:
            freed += st.st_size
    return linked, freed


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    canonical, *others = (Path(a) for a in argv)
    if not canonical.is_dir():
        print(f"[dedupe] {canonical} is not a directory", file=sys.stderr)
        return 2
    for other in others:
        if not other.is_dir():
            continue
        linked, freed = link_twins(canonical, other)
        print(f"[dedupe] {other}: {linked} files linked to {canonical}, "
              f"{freed / 2**30:.1f} GiB freed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
