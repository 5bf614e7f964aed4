# SPDX-License-Identifier: Apache-2.0
"""The sweep's probe and the source reading of lab/fp4_moe_lab/release_read.py, on this world's
vLLM: the probe script runs (it once imported modules that had moved, and every sweep row would
have said "the probe did not run"), and reading the release's Python files alone, ahead of a
world's own vLLM, gives the probe the same answer the installed release gives it (the reading
the release table rests on). Here the files are this world's own, copied without the compiled
libraries, as a wheel's are unpacked."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import vllm

from fp4_moe_lab import release_read, sweep

ROOT = Path(__file__).resolve().parents[2]


def test_the_release_read_gives_the_probe_the_installed_release_answer(tmp_path):
    r = subprocess.run([sys.executable, "-c", sweep.PROBE], capture_output=True, text=True,
                       timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    installed = json.loads(r.stdout.splitlines()[-1])
    assert installed["vllm"] == vllm.__version__ and installed["design"], installed
    assert installed["patches"] and installed["findings"]

    source = tmp_path / "source"
    shutil.copytree(Path(vllm.__file__).parent, source / "vllm",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    read = release_read.read_in(Path(sys.prefix), vllm.__version__, source, ROOT)
    assert "error" not in read, read
    assert read["probe"] == installed

    wrong = release_read.read_in(Path(sys.prefix), "0.0.1", source, ROOT)
    assert wrong["error"] == f"vLLM {vllm.__version__} was read, not the wheel's 0.0.1"


def test_a_release_whose_worlds_disagree_says_so():
    probe = {"design": "nvfp4_oracle", "patches": ["a"], "findings": {"experts_call": "X"}}
    other = {**probe, "findings": {"experts_call": ""}}
    one = release_read.row_of("0.20.0", {"w1": {"probe": probe}, "w2": {"error": "gguf"}}, "c")
    assert one["agree"] and one["read_in"] == ["w1"] and one["design"] == "nvfp4_oracle"
    two = release_read.row_of("0.20.0", {"w1": {"probe": probe}, "w2": {"probe": other}}, "c")
    assert not two["agree"]
    table = release_read.render({"0.20.0": two, "0.21.0": release_read.row_of(
        "0.21.0", {"w1": {"error": "no wheel"}}, "c")})
    assert "w1, w2 (**they disagree**)" in table
    assert "| 0.21.0 | **not read**: w1: no wheel |" in table
