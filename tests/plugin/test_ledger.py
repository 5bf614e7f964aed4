"""Every replaced symbol has a complete ledger entry, and docs/PATCHES.md says the same."""

from pathlib import Path

import pytest

from vllm_fp4_moe_plugin.patches import LEDGER, render_ledger_markdown

pytestmark = pytest.mark.cpu

DOC = Path(__file__).resolve().parents[2] / "docs" / "PATCHES.md"


@pytest.mark.parametrize("patch", LEDGER, ids=lambda p: f"{p.target}@{p.designs[0]}")
def test_entry_is_complete(patch):
    for field in ("why", "how", "upstream", "remove_when"):
        assert len(getattr(patch, field).strip()) > 20, (patch.target, field)


def test_doc_matches_code():
    assert DOC.read_text() == render_ledger_markdown() + "\n", (
        "docs/PATCHES.md is stale: run `python -m vllm_fp4_moe_plugin.patches > docs/PATCHES.md`")
