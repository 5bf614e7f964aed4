"""``vllm-fp4-moe matrix`` itself, every layout, on the installed oracle-design release (CI:
vLLM 0.34.0): exit 0 (every row ok), and the rows docs/ and the README publish are what the
command computes today, float for float."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fp4_moe_plugin import support

pytestmark = [pytest.mark.cpu, pytest.mark.multiproc, pytest.mark.slow]

DOCS = Path(__file__).resolve().parents[2] / "docs" / "matrix-vllm-0.34.0.json"


@pytest.fixture(scope="module")
def rows():
    r = subprocess.run([sys.executable, "-m", "vllm_fp4_moe_plugin.cli", "matrix", "--json"],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout)


def test_every_row_ok_and_holes_where_the_support_model_says(rows):
    import vllm

    assert {row["layout"] for row in rows} == set(support.LAYOUTS)
    for row in rows:
        assert row["ok"], row
        hole = support.stock_hole(row["design"], row["format"], row["layout"]) is not None
        # Reference check: the support model (what docs/SUPPORT.md is checked against).
        assert row["stock_affected"] is hole, row
        assert row["bit_identical"] is (not hole), row
    if vllm.__version__ == "0.34.0":
        published = json.loads(DOCS.read_text())
        assert rows == published
