# SPDX-License-Identifier: Apache-2.0
"""The vLLM-free support model and ledger (tests/ut/test_support.py, test_support_doc.py,
test_ledger.py: the unit tier) checked against what needs the installed vLLM or torch: vLLM's
own expert map, the installed probe's findings, and the published uncalibrated-expert rows."""

import json
from pathlib import Path

import pytest

from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.patches import compat


@pytest.mark.parametrize("num_experts", [8, 7, 16])
@pytest.mark.parametrize("ep_size", [1, 2, 3, 4])
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_ep_slices_match_vllms_expert_map(num_experts, ep_size, placement):
    from vllm.model_executor.layers.fused_moe.layer import determine_expert_map

    slices = support.ep_slices(num_experts, ep_size, placement)
    for rank, owned in enumerate(slices):
        _, expert_map = determine_expert_map(ep_size, rank, num_experts, placement)
        # Reference check: vLLM's own map, global id -> local id (-1: not on this rank).
        want = (list(range(num_experts)) if expert_map is None
                else [e for e in range(num_experts) if int(expert_map[e]) >= 0])
        assert owned == want


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "docs" / "data").glob(
    "uncalibrated-vllm-*.json")), ids=lambda p: p.name)
def test_published_uncalibrated_rows_agree_with_the_support_model(path):
    """docs/data/uncalibrated-*.json (ROOT-CAUSE §13) hold what stock.stock_wrong_with_uncalibrated
    says, and the plugin at the reference on every row (the per-world suites re-run a subset)."""
    from tests import uncalibrated_checks

    rows = json.loads(path.read_text())
    from fp4_moe_lab.simulation.planted_scales import CASES

    assert {r["case"] for r in rows} == set(CASES)
    for row in rows:
        uncalibrated_checks.check_row(row, row["design"])


def test_the_installed_probe_reports_exactly_the_declared_findings():
    obs = compat.probe()
    # Reference check: the keys the ledger's predicates are checked against above.
    assert obs.patchable and set(obs.findings) == set(compat.FINDINGS[obs.design]), obs
