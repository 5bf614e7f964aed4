# SPDX-License-Identifier: Apache-2.0
"""Which Blackwell GPUs the oracle seam can report to vLLM (``blackwell_oracle``'s
``capability``). No imports: the lab CLI validates ``matrix --capability`` with this before
torch or vLLM load."""

from __future__ import annotations

#: compute capability -> the GPUs that have it (docs/SUPPORT.md, GPU families)
GPUS = {"10.0": "B200/GB200", "10.3": "B300/GB300", "12.0": "RTX PRO 6000/RTX 5090",
        "12.1": "DGX Spark GB10"}
CAPABILITIES = tuple(GPUS)
DEFAULT_CAPABILITY = "10.0"


def parse_capability(text: str) -> tuple[int, int]:
    """``"12.0"`` -> ``(12, 0)``. Anything but :data:`CAPABILITIES` raises ``ValueError`` naming
    them, so a typo never silently simulates another GPU."""
    if text not in GPUS:
        named = ", ".join(f"{c} ({g})" for c, g in GPUS.items())
        raise ValueError(f"capability {text!r} is not simulated; choose from {named}")
    major, minor = text.split(".")
    return int(major), int(minor)
