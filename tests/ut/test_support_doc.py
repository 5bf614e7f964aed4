# SPDX-License-Identifier: Apache-2.0
"""docs/SUPPORT.md's table and every published matrix agree with the support model
(``support.stock_hole``), the one place that encodes where stock vLLM is wrong."""

import json
import re
from pathlib import Path

import pytest

from tests import pass_marks
from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.support import LAYOUTS

DOCS = Path(__file__).resolve().parents[2] / "docs"
CELL = {"plugin": support.WRONG, "plugin (fails)": support.FAILS, "upstream": None}


def _table():
    lines = [line for line in (DOCS / "SUPPORT.md").read_text().splitlines()
             if line.startswith("| ")]
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:3] == ["vLLM", "plugin design", "format"]
    rows, release = [], None
    for line in lines[1:]:  # the |---| line does not start with "| "
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) != len(head):
            break  # the next table
        release = cells[0] or release
        rows.append((release, dict(zip(head, cells))))
    return head[3:-1], rows


def test_support_table_matches_the_model():
    layouts, rows = _table()
    assert set(layouts) == set(support.LAYOUTS)
    seen = set()
    for release, row in rows:
        design = support.design_for_release(re.split(r"[ ,–-]", release)[0]).value
        fmt = {"ModelOpt": "modelopt", "compressed-tensors": "compressed-tensors"}[row["format"]]
        seen.add((design, fmt))
        for layout in layouts:
            cell = row[layout]
            if cell == "n/a":
                with pytest.raises(ValueError):
                    support.stock_hole(design, fmt, layout)
                continue
            # Reference check: the model's verdict for this design, format and layout.
            assert CELL[cell] == support.stock_hole(design, fmt, layout), (release, fmt, layout)
    assert seen == {(d.value, f) for d in support.DESIGNS
                    for f in ("modelopt", "compressed-tensors")}


@pytest.mark.parametrize("path", sorted((DOCS / "data").glob("matrix*.json")), ids=lambda p: p.name)
def test_published_matrices_match_the_model(path):
    rows = json.loads(path.read_text())
    assert rows
    for row in rows:
        if row.get("vllm_refuses"):  # vLLM builds no such layer (e.g. TRT-LLM on 12.x): no
            assert row["ok"] and row["stock_error"] == row["plugin_error"], row  # answer to judge
            continue
        kernel = row["backend"].removeprefix("auto: ")  # an auto row names vLLM's pick
        hole = support.stock_hole(row["design"], row["format"], row["layout"], kernel)
        assert row["ok"], row
        assert row["stock_affected"] is (hole is not None), (path.name, row["format"],
                                                             row["layout"])
        assert (row["stock_error"] is not None) is (hole == support.FAILS), row


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "docs" / "data").glob(
    "llmcompressor-dead-vllm-*.json")), ids=lambda p: p.name)
def test_published_real_checkpoint_rows_hold(path):
    """docs/data/llmcompressor-dead-*.json (ROOT-CAUSE §13): the real dead-expert checkpoint's rows
    meet what the per-world suites assert on it."""
    from tests import real_quantizer_checks

    rows = json.loads(path.read_text())
    assert {r["layout"] for r in rows} == {"single", "dp_ep_allgather"}
    real_quantizer_checks.check_dead_rows(rows)


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "docs" / "data").glob(
    "router-weight-vllm-*.json")), ids=lambda p: p.name)
def test_published_router_weight_rows_hold(path):
    """docs/data/router-weight-vllm-*.json (Llama-4's router weight on the input, SUPPORT.md):
    stock weights each token twice (or, under DP up to 0.13.x, on the output), far from the
    weight-once reference; the plugin is at it, on every kernel that weights again."""
    rows = json.loads(path.read_text())
    version, _, kernel = path.stem.removeprefix("router-weight-vllm-").partition("-")
    assert {r["vllm_version"] for r in rows} == {version}
    if kernel == "trtllm":  # TRT-LLM's modular experts, which vLLM runs under DP+EP only
        want, layouts = {"flashinfer_trtllm"}, {"dp_ep_allgather", "dp_ep_all2allv",
                                                "dp_ep_one_sided"}
    else:  # vLLM's CUTLASS NVFP4 MoE runs under EP from 0.32.0
        want = {"flashinfer_cutlass", "vllm_cutlass"} if version >= "0.32" else {
            "flashinfer_cutlass"}
        layouts = {"single", "tp_ep", "dp_ep_allgather"}
    assert {r["backend"] for r in rows} == want
    assert {r["layout"] for r in rows} == layouts
    for r in rows:
        assert r["ok"] and r["stock_error"] is None and r["plugin_error"] is None, r
        tol = pass_marks.router_weight_once(LAYOUTS[r["layout"]].tp)
        assert r["stock_rel_err"] >= 0.2 and r["plugin_rel_err"] <= tol, r


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "docs" / "data").glob(
    "shared-expert-vllm-*.json")), ids=lambda p: p.name)
def test_published_shared_expert_rows_hold(path):
    """docs/data/shared-expert-vllm-*.json (SUPPORT.md, shared experts beside routed ones): the
    plugin at the reference on every row, and stock's output bit for bit wherever stock is not
    off (vLLM's CUTLASS under EP aside: its unzeroed-row hole shows weakly there, below the
    mark, and the plugin zeroes the rows)."""
    rows = json.loads(path.read_text())
    version = path.stem.removeprefix("shared-expert-vllm-").partition("-")[0]
    assert rows and {r["vllm_version"] for r in rows} == {version}
    assert {r["layout"] for r in rows} == {"single", "tp_ep", "dp_ep_allgather"}
    for r in rows:
        assert r["ok"] and r["stock_error"] is None and r["plugin_error"] is None, r
        assert r["plugin_rel_err"] <= pass_marks.PLUGIN_BOUND, r
        if r["stock_affected"]:
            assert r["stock_rel_err"] >= pass_marks.AFFECTED_FACTOR * pass_marks.PLUGIN_BOUND, r
        elif r["backend"] != "vllm_cutlass" or r["layout"] == "single":
            assert r["bit_identical"], r
