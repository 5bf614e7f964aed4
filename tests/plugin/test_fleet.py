# SPDX-License-Identifier: Apache-2.0
"""The fleet check on real process groups: a rank that runs the fix never serves next to one that
does not, and a plugin that is off (or absent) never stops stock vLLM.

Each rank is a fresh process with its own environment (the switch on, ``0``, unset; another
plugin version; the plugin not loaded, as with ``VLLM_PLUGINS`` without ``fp4_moe``), loads its
plugins through vLLM's own loader, and runs vLLM's real ``init_distributed_environment`` and
``initialize_model_parallel`` over gloo as a worker does, as the stages of a pipeline-parallel
deployment. Rank 0's stage is dense (it never builds an NVFP4 MoE layer, like DeepSeek's first
layers); the others register the first tensor of an NVFP4 MoE layer, as ``create_weights`` does.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest

pytestmark = pytest.mark.multiproc

# The bound on what the check adds where nobody runs the fix (write one key, read the others').
OFF_BUDGET_S = 1.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, setup: dict, queue) -> None:
    import os

    for k in [k for k in os.environ if k.startswith("VLLM_FP4_MOE")]:
        del os.environ[k]
    os.environ.update(setup.get("env", {}))
    os.environ["VLLM_PLUGINS"] = "" if setup.get("absent") else "fp4_moe"
    time.sleep(setup.get("delay_s", 0))
    import torch
    from vllm.config import DeviceConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state as ps

    import vllm_fp4_moe_plugin as plugin
    from vllm_fp4_moe_plugin.patches import fleet

    if setup.get("version"):
        plugin.__version__ = setup["version"]
    if setup.get("unknown_design"):  # a vLLM whose MoE internals match no known design
        from vllm_fp4_moe_plugin.patches import compat

        compat._probe = lambda: compat.Observation(None, False, "test: unknown design")
    fleet.GRACE_S = setup.get("grace_s", fleet.GRACE_S)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # vLLM's loader: register() runs, or (absent) does not
    cfg = VllmConfig(device_config=DeviceConfig(device="cpu"),
                     parallel_config=ParallelConfig(pipeline_parallel_size=world))
    arrived = time.time()
    try:
        with set_current_vllm_config(cfg):
            ps.init_distributed_environment(
                world_size=world, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                local_rank=rank, backend="gloo")
            ps.initialize_model_parallel(1, world)
            if rank > 0:  # this stage holds MoE layers: the first NVFP4 MoE tensor registers
                torch.nn.Module().register_parameter(
                    "w13_weight_scale_2", torch.nn.Parameter(torch.ones(4), requires_grad=False))
        checked = fleet.checked()
        result = ("ok", checked[0] if checked else None)
    except Exception as exc:  # the fleet's refusal, or (a rank without the plugin) its peer gone
        result = (type(exc).__name__, str(exc))
    queue.put((rank, result, arrived, time.time(), plugin.state()[0],
               fleet.spent_s))
    try:
        ps.destroy_model_parallel()
        ps.destroy_distributed_environment()
    except Exception:
        pass


def _run(setups: list[dict]) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, len(setups), port, s, queue))
             for r, s in enumerate(setups)]
    for p in procs:
        p.start()
    out = {}
    try:
        for _ in procs:
            rank, result, arrived, done, state, spent = queue.get(timeout=240)
            out[rank] = {"result": result, "arrived": arrived, "done": done, "state": state,
                         "spent_s": spent}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


ON = {"env": {"VLLM_FP4_MOE_PLUGIN": "1"}}
UNSET: dict = {}
ZERO = {"env": {"VLLM_FP4_MOE_PLUGIN": "0"}}
ABSENT = {"absent": True}


def test_ranks_that_run_the_fix_meet_although_the_first_stage_is_dense():
    """PP=3, stage 0 dense: every rank takes part at vLLM's distributed initialisation (before
    the plugin's rendezvous, the first NVFP4 MoE layer was the trigger and stage 0 never came)."""
    out = _run([ON, ON, ON])
    assert [out[r]["result"] for r in range(3)] == [("ok", "agreed")] * 3
    assert {out[r]["state"] for r in range(3)} == {"active"}


@pytest.mark.parametrize("off", [UNSET, ZERO], ids=["unset", "zero"])
def test_off_serves_as_stock_without_waiting(off):
    """Off everywhere, dense first stage: nothing refuses, and the check costs milliseconds."""
    out = _run([off, off, off])
    for r in range(3):
        assert out[r]["result"] == ("ok", "stock"), out[r]
        assert out[r]["state"] == "inert"
        assert out[r]["spent_s"] < OFF_BUDGET_S, out[r]["spent_s"]


@pytest.mark.parametrize("off", [UNSET, ZERO], ids=["unset", "zero"])
def test_a_rank_without_the_plugin_next_to_ranks_that_are_off_serves(off):
    """A node whose image lacks the plugin (or VLLM_PLUGINS without fp4_moe), the others off:
    stock everywhere, no wait for the rank that never reports."""
    out = _run([{**off, "grace_s": 30}, ABSENT])
    assert out[0]["result"] == ("ok", "stock"), out[0]
    assert out[0]["spent_s"] < OFF_BUDGET_S, out[0]["spent_s"]
    assert out[1]["result"] == ("ok", None) and out[1]["state"] is None  # never registered


def test_a_rank_without_the_plugin_next_to_ranks_that_run_the_fix_is_refused():
    """Rank 1 does not load the plugin: rank 0 (switch on) refuses after the grace, naming rank
    1 and the fix; rank 1 ends too (its peer is gone), nobody waits longer."""
    out = _run([{**ON, "grace_s": 3}, ABSENT])
    kind, msg = out[0]["result"]
    assert kind == "FleetIncompleteError", msg
    assert "rank(s) 1 of the 2 ranks" in msg and "VLLM_PLUGINS without fp4_moe" in msg, msg
    assert "active (VLLM_FP4_MOE_PLUGIN=1)" in msg and "(host" in msg, msg
    assert out[0]["done"] - out[0]["arrived"] < 3 + 10
    assert out[1]["result"][0] != "ok", out[1]  # its collective with rank 0 failed: it ended
    assert out[1]["done"] - out[0]["done"] < 60


@pytest.mark.parametrize("off", [UNSET, ZERO], ids=["unset", "zero"])
def test_an_off_rank_next_to_an_on_rank_stops_both_as_soon_as_both_arrive(off):
    """Rank 1 starts 6 s late without the switch: both raise the same error seconds after rank
    1 arrives (no timeout involved), naming both ranks, their stages and the fix."""
    out = _run([ON, {**off, "delay_s": 6}])
    last = max(o["arrived"] for o in out.values())
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetMismatchError", msg
        assert out[rank]["done"] - last < 10, (rank, out[rank]["done"] - last)
        assert "rank 0 (host" in msg and "rank 1 (host" in msg and "PP 1/2" in msg, msg
        assert "active (VLLM_FP4_MOE_PLUGIN=1)" in msg, msg
        switch = "VLLM_FP4_MOE_PLUGIN=0" if off else "VLLM_FP4_MOE_PLUGIN unset"
        assert f"off ({switch})" in msg, msg
        assert "Fix: Set VLLM_FP4_MOE_PLUGIN to the same value" in msg, msg


def test_another_plugin_version_is_named():
    out = _run([ON, {**ON, "version": "0.0.9"}])
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetMismatchError", msg
        assert "plugin 0.0.9" in msg and "Install the same vllm-fp4-moe-plugin version" in msg
        assert "Set VLLM_FP4_MOE_PLUGIN" not in msg, msg  # the switch is not what differs


def test_an_inactive_rank_is_named_with_its_reason():
    out = _run([ON, {**ON, "unknown_design": True}])
    assert out[1]["state"] == "inactive"
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetMismatchError", msg
        assert "inactive: test: unknown design" in msg, msg
        assert "Install the same vLLM release" in msg, msg  # the design differs too


def test_workers_whose_own_environment_turns_the_switch_off_are_refused():
    """Every rank is off, but they were launched by a process with the switch on (a Ray
    cluster whose nodes were started with VLLM_FP4_MOE_PLUGIN=0: Ray keeps a worker's own
    value): no rank loads, and the message says where to fix it."""
    launched_off = {"env": {"VLLM_FP4_MOE_PLUGIN": "0", "VLLM_FP4_MOE_PLUGIN_LAUNCHER": "1"}}
    out = _run([launched_off, launched_off])
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetMismatchError", msg
        assert "ranks 0, 1: started by a process with VLLM_FP4_MOE_PLUGIN=1" in msg, msg
        assert "where `ray start` runs" in msg, msg
