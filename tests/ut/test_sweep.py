# SPDX-License-Identifier: Apache-2.0
"""The release sweep's bookkeeping (lab/fp4_moe_lab/sweep.py): what a table row counts as a hole,
and the snapshot every world installs from."""

import subprocess

import pytest

from fp4_moe_lab import sweep


def _row(layout, ok=True, affected=False, stock_error=None, refuses=False, plugin=1e-3):
    return {"format": "compressed-tensors", "layout": layout, "backend": "flashinfer_cutlass",
            "ok": ok, "stock_affected": affected, "stock_error": stock_error,
            "vllm_refuses": refuses, "plugin_rel_err": plugin}


def test_a_hole_is_a_wrong_stock_answer_not_a_row_stock_cannot_run():
    rows = [_row("dp_ep_allgather", affected=True),
            _row("single"),
            _row("tp_ep", ok=False, affected=True, stock_error="AttributeError: no kernel",
                 plugin=None),
            _row("dp", affected=True, refuses=True, plugin=float("nan"))]
    s = sweep.summary(rows, 1)
    assert s["stock_holes"] == ["compressed-tensors/dp_ep_allgather/flashinfer_cutlass"]
    assert s["rows"] == 4 and s["ok"] is False and s["vllm_refuses"] == 1
    assert [r["layout"] for r in s["not_ok"]] == ["tp_ep"]
    assert s["worst_plugin_rel_err"] == 1e-3  # neither the crash nor the refused row


def test_the_table_says_no_for_a_run_with_a_row_not_ok():
    table = {"0.17.0": {"design": "nvfp4_oracle", "patches": ["a"], "date": "2026-12-06",
                        "seconds": 9, "matrix": sweep.summary([_row("single", ok=False)], 1),
                        "uncalibrated": sweep.summary([_row("single")], 0)}}
    line = sweep.render(table).splitlines()[-1]
    assert line.startswith("| 0.17.0 | nvfp4_oracle | 1 | **no** (1) | 0 |"), line
    assert "| yes (1) |" in line


def test_the_snapshot_is_the_committed_tree(tmp_path, monkeypatch):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=sweep.ROOT,
                      capture_output=True).returncode:
        pytest.fail("the unit tier runs in a git checkout (CI clones the repository)")
    monkeypatch.setattr(sweep, "WORLDS", tmp_path)
    src, commit = sweep.snapshot()
    assert src == tmp_path / f"src-{commit[:12]}"
    tracked = subprocess.run(["git", "show", f"{commit}:lab/fp4_moe_lab/sweep.py"],
                             cwd=sweep.ROOT, capture_output=True, text=True).stdout
    assert (src / "lab" / "fp4_moe_lab" / "sweep.py").read_text() == tracked
    assert (src / "setup.cfg").is_file() and not (src / ".git").exists()
    assert sweep.snapshot() == (src, commit)  # exported once


def test_sweeps_started_together_share_one_snapshot(tmp_path, monkeypatch):
    """Another sweep on the same commit exports the tree while this one does: each into its own
    part, the second rename finds the tree there and keeps it."""
    import threading

    monkeypatch.setattr(sweep, "WORLDS", tmp_path)
    out, errors = [], []

    def run():
        try:
            out.append(sweep.snapshot())
        except Exception as exc:  # the failure this test is about
            errors.append(exc)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(out)) == 1, (errors, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == [out[0][0].name]  # no part left


def test_a_world_without_flashinfer_keeps_every_other_requirement():
    requires = ["torch==2.14.0", "flashinfer-python==0.7.3", "flashinfer_cubin==0.7.3",
                'numba==0.61.2; python_version == "3.11"', 'tensorizer; extra == "tensorizer"',
                "transformers>=4.56"]
    assert sweep.without_flashinfer(requires) == [
        "torch==2.14.0", 'numba==0.61.2; python_version == "3.11"', "transformers>=4.56"]


def test_a_release_pinned_by_name_can_be_built_from_its_pins(tmp_path):
    assert sweep._pinned_by_name(sweep.ROOT / "constraints" / "vllm-0.34.0.txt")
    loose = tmp_path / "vllm-0.99.0.txt"
    loose.write_text("# torch only\ntorch==2.14.0\n")
    assert not sweep._pinned_by_name(loose)
    assert not sweep._pinned_by_name(tmp_path / "absent.txt")


def test_measuring_one_part_keeps_the_rows_other_parts(tmp_path, monkeypatch):
    """``--only gate_up_split`` adds that part to a measured row and leaves the rest as measured;
    a row that has it is skipped the next time."""
    table = tmp_path / "releases.json"
    old = {"release": "0.11.0", "date": "2026-11-01", "commit": "aaa", "error": None,
           "design": "init_prepare_finalize", "patches": ["a"], "seconds": 600,
           "matrix": sweep.summary([_row("single")], 0),
           "uncalibrated": sweep.summary([_row("single")], 0)}
    table.write_text(sweep.json.dumps({"0.11.0": old}))
    measured = []

    def fake_measure(release, src, commit, keep=False, steps=(), chain=False):
        measured.append((release, steps, chain))
        return {"release": release, "date": "2026-12-06", "commit": commit[:12], "error": None,
                "seconds": 90, "design": "init_prepare_finalize",
                "gate_up_split": sweep.summary([_row("single", affected=True)], 0),
                "gate_up_split_s": 80}

    monkeypatch.setattr(sweep, "WORLDS", tmp_path / "worlds")  # --chain deletes its world
    monkeypatch.setattr(sweep, "measure", fake_measure)
    monkeypatch.setattr(sweep, "snapshot", lambda: (tmp_path, "b" * 40))
    monkeypatch.setattr(sweep, "publish", lambda table: None)
    args = ["--release", "0.11.0", "--only", "gate_up_split", "--chain", "--table", str(table)]
    assert sweep.main(args) == 0
    row = sweep.load(table)["0.11.0"]
    assert row["matrix"] == old["matrix"] and row["uncalibrated"] == old["uncalibrated"]
    assert row["date"] == "2026-11-01" and row["seconds"] == 600
    assert row["gate_up_split"]["stock_holes"] and row["gate_up_split_s"] == 80
    assert row["gate_up_split_measured"]["commit"] == "b" * 12
    assert measured == [("0.11.0", ("gate_up_split",), True)]
    assert "| 0.001 | yes (1) | yes (1) | 2026-11-01 |" in sweep.render(sweep.load(table))
    assert sweep.main(args) == 0 and len(measured) == 1  # has it: skipped
