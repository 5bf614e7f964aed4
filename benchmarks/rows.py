# SPDX-License-Identifier: Apache-2.0
"""One benchmark row = one side-by-side ratio, and the one table they are printed in.

Why a shared shape: every row is a ratio measured in the same run, each with its target,
so a reader (and the smoke test) can tell at a glance what was met and what was MISSED.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional


@dataclass
class Row:
    item: int
    name: str
    unit: str
    plugin: Optional[float]
    baseline: Optional[float]
    baseline_name: str
    target: str
    ok: Optional[bool]  # None: informational, no target
    extra: dict = field(default_factory=dict)

    @property
    def ratio(self) -> Optional[float]:
        if self.plugin is None or self.baseline is None:
            return None
        if self.baseline == 0:
            return 0.0 if self.plugin == 0 else math.inf
        return self.plugin / self.baseline

    @property
    def status(self) -> str:
        return "info" if self.ok is None else ("ok" if self.ok else "MISSED")

    def as_dict(self) -> dict:
        d = asdict(self)
        d["ratio"] = self.ratio
        d["status"] = self.status
        return d


def _num(v: Optional[float]) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    a = abs(v)
    if a >= 1000 or a < 1e-3:
        return f"{v:.3g}"
    return f"{v:.4g}"


def format_table(rows: list[Row]) -> str:
    head = ("#", "row", "unit", "plugin", "baseline", "baseline is", "ratio", "target", "status")
    body = [(str(r.item), r.name, r.unit, _num(r.plugin), _num(r.baseline), r.baseline_name,
             _num(r.ratio), r.target, r.status) for r in rows]
    widths = [max(len(c) for c in col) for col in zip(head, *body)]
    fmt = " | ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
    lines += [fmt.format(*b) for b in body]
    return "\n".join(lines)


def format_markdown(rows: list[Row]) -> str:
    head = ("#", "row", "unit", "plugin", "baseline", "baseline is", "ratio", "target", "status")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (str(r.item), r.name, r.unit, _num(r.plugin), _num(r.baseline),
                 r.baseline_name, _num(r.ratio), r.target, r.status)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)
