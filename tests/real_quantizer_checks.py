# SPDX-License-Identifier: Apache-2.0
"""What every release world asserts about the checkpoints real quantizers wrote, one
copy: llmcompressor 0.14's routed calibration left experts uncalibrated with uninitialised memory
as their input global scales (accuracy/models/SCALES.md); real vLLM layers load them.
"""

from pathlib import Path

from tests.pass_marks import AFFECTED_FACTOR, PLUGIN_BOUND

MODELS = Path(__file__).resolve().parents[1] / "accuracy" / "models"
DEAD = MODELS / "qwen3moe-add-nvfp4-ct-routed-dead"
LAYERS = (0, 1)
NUM_EXPERTS = 8


def check_dead_rows(rows: list[dict]) -> None:
    """The plugin at the ideal NVFP4 answer (uncalibrated experts at the calibrated max amax),
    warning about exactly the experts the rule finds; stock far off (NaN counts as infinitely)."""
    assert rows
    for row in rows:
        where = f"{row['layout']} layer {row['layer']}"
        bad = row["uncalibrated"]["w13"] + row["uncalibrated"]["w2"]
        assert bad, f"{where}: the fixture must hold an uncalibrated expert"
        # Reference check: same seeds, same file, the references from the repaired experts.
        assert row["plugin_error"] is None and row["plugin_rel_err"] <= PLUGIN_BOUND, (where, row)
        assert row["ok"], where
        assert row["plugin_warnings"], where
        ep = 2 if "_ep" in row["layout"] else 1  # compressed-tensors ranks name local experts
        local = NUM_EXPERTS // ep
        for e in set(bad):
            named = f"{e % local} (" if ep > 1 else f"{e} ("
            rank = f"local to EP rank {e // local}" if ep > 1 else ""
            assert any(named in w and rank in w for w in row["plugin_warnings"]), (where, e)
        assert row["stock_rel_err"] >= AFFECTED_FACTOR * PLUGIN_BOUND, (where, row)
