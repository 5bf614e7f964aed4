# SPDX-License-Identifier: Apache-2.0
"""docs/PATCHES.md, rendered from the patch ledger (``patches.registry.SLICES``):
``python -m fp4_moe_lab.ledger_doc > docs/PATCHES.md``; tests/ut/test_ledger.py keeps the
file in sync. A development tool, so it lives in the lab, not in the serving wheel."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import vllm_fp4_moe_plugin
from vllm_fp4_moe_plugin.patches.registry import ONE_MODULE, SLICES

PACKAGE_DIR = Path(vllm_fp4_moe_plugin.__file__).parent

WIDTH = 100
INTRO = ("Generated from the folders of `vllm_fp4_moe_plugin/patches/` (each: its records in "
         "`__init__.py`, its probe, its replacements; `patches/registry.py` names them, and "
         "`patches/fleet_rendezvous.py` and each one-module patch, a module assigning `PATCH`, are "
         "one file each) by "
         "`python -m fp4_moe_lab.ledger_doc`; a test keeps it in sync. Each entry is applied "
         "only when its design is installed and its predicate over the findings of its folder's "
         "probe says the hole is there.")


def _item(label: str, text: str) -> list[str]:
    return textwrap.wrap(f"- **{label}:** {' '.join(text.split())}", WIDTH,
                         subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def render() -> str:
    lines = ["# Patch ledger", "", *textwrap.wrap(INTRO, WIDTH), ""]
    theirs = {e.target for x in ONE_MODULE for e in x.entries}
    entries = [(s.design.label if s.design else "every design (applied by register())", p)
               for s in SLICES for p in s.patches if p.target not in theirs]
    entries += [(", ".join(d.label for d in x.designs) + " (a one-module patch)", p)
                for x in ONE_MODULE for p in x.entries]
    for design, p in entries:
        lines += [f"## `{p.attr}`", ""]
        module, _, builder = p.build.partition(":")
        source = Path(importlib.util.find_spec(module).origin).relative_to(PACKAGE_DIR)  # not run
        built = f"`{builder}` in `{source.as_posix()}`"
        for label, text in (("Module", f"`{p.module}`"), ("Design", design), ("Built by", built),
                            ("Needed when", p.needed.__doc__),
                            ("Why", p.why), ("How", p.how), ("Upstream", p.upstream),
                            ("Remove when", p.remove_when)):
            lines += _item(label, text)
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    print(render())
