# SPDX-License-Identifier: Apache-2.0
"""docs/PATCHES.md, rendered from the patch ledger (``vllm_fp4_moe_plugin.patches.LEDGER``):
``python -m fp4_moe_lab.ledger_doc > docs/PATCHES.md``; tests/ut/test_ledger.py keeps the
file in sync. A development tool, so it lives in the lab, not in the serving wheel."""

from __future__ import annotations

import textwrap

from vllm_fp4_moe_plugin.patches import LEDGER

WIDTH = 100
INTRO = ("Generated from the slices in `vllm_fp4_moe_plugin/patches/<design>/` by `python -m "
         "fp4_moe_lab.ledger_doc`; a test keeps it in sync. Each entry is applied only when its "
         "design is installed and its predicate over the probe's findings (`compat.FINDINGS`) "
         "says the hole is there.")


def _item(label: str, text: str) -> list[str]:
    return textwrap.wrap(f"- **{label}:** {' '.join(text.split())}", WIDTH,
                         subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def render() -> str:
    lines = ["# Patch ledger", "", *textwrap.wrap(INTRO, WIDTH), ""]
    for p in LEDGER:
        design = p.design.label if p.design else "every design (applied by register())"
        lines += [f"## `{p.target}`", ""]
        for label, text in (("Design", design), ("Needed when", p.needed.__doc__),
                            ("Why", p.why), ("How", p.how), ("Upstream", p.upstream),
                            ("Remove when", p.remove_when)):
            lines += _item(label, text)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
