"""The fleet check: ranks that run the plugin differently never load, on any rank.

Each rank is a fresh process with its own environment (the switch on, off, unset; another plugin
version; no plugin at all), a real gloo world (``init_process_group`` over TCP, as vLLM's
workers do), vLLM's real import of its ModelOpt NVFP4 module (which installs the patches when the
switch is on), and the first NVFP4 MoE tensor registered on a layer, as ``create_weights`` does.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import time

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.multiproc]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, setup: dict, queue) -> None:
    import os

    for k in [k for k in os.environ if k.startswith("VLLM_FP4_MOE")]:
        del os.environ[k]
    os.environ.update(setup.get("env", {}))
    os.environ["VLLM_FP4_MOE_PLUGIN_TIMEOUT_S"] = str(setup.get("timeout_s", 60))
    time.sleep(setup.get("delay_s", 0))
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        import vllm_fp4_moe_plugin as plugin
        from vllm_fp4_moe_plugin import fleet

        if setup.get("version"):
            plugin.__version__ = setup["version"]
        if setup.get("unknown_design"):  # a vLLM whose MoE internals match no known design
            from vllm_fp4_moe_plugin import compat

            compat._probe = lambda: compat.Observation(None, False, "test: unknown design")
        if not setup.get("absent"):  # what vLLM's plugin loader does in each process
            plugin.register()
        import vllm.model_executor.layers.quantization.modelopt  # noqa: F401  (as vLLM does)

        time.sleep(setup.get("build_delay_s", 0))
        layer = torch.nn.Module()
        arrived = time.time()
        try:  # what ModelOptNvFp4FusedMoE.create_weights registers first of the scales
            layer.register_parameter("w13_weight_scale_2",
                                     torch.nn.Parameter(torch.ones(4), requires_grad=False))
            states = fleet._checked
            result = ("ok", [s.mode for s in states] if states else None)
        except (fleet.FleetMismatchError, fleet.FleetTimeout) as exc:
            result = (type(exc).__name__, str(exc))
        queue.put((rank, result, arrived, time.time(), plugin.state()[0]))
        if setup.get("absent"):
            time.sleep(setup.get("absent_hold_s", 0))
    finally:
        dist.destroy_process_group()


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
            rank, result, arrived, done, state = queue.get(timeout=240)
            out[rank] = {"result": result, "arrived": arrived, "done": done, "state": state}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


ON = {"env": {"VLLM_FP4_MOE_PLUGIN": "1"}}


def test_ranks_that_agree_load_and_say_so():
    out = _run([ON, ON])
    assert [out[r]["result"] for r in (0, 1)] == [("ok", ["active", "active"])] * 2
    assert {out[r]["state"] for r in (0, 1)} == {"active"}


@pytest.mark.parametrize("off", [{}, {"env": {"VLLM_FP4_MOE_PLUGIN": "0"}}],
                         ids=["unset", "zero"])
def test_a_rank_that_is_off_stops_every_rank_within_seconds_of_the_last_arrival(off):
    """Rank 1 starts late and without the switch: every rank raises the same error, naming
    rank 1 and the fix, seconds after rank 1 arrives (not after the timeout)."""
    late = {**off, "build_delay_s": 6}
    out = _run([{**ON, "timeout_s": 120}, {**late, "timeout_s": 120}])
    last = max(o["arrived"] for o in out.values())
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetMismatchError", msg
        assert out[rank]["done"] - last < 10, (rank, out[rank]["done"] - last)
        assert "rank 0 (host" in msg and "rank 1 (host" in msg, msg
        assert "active (VLLM_FP4_MOE_PLUGIN=1)" in msg, msg
        switch = "VLLM_FP4_MOE_PLUGIN=0" if off else "VLLM_FP4_MOE_PLUGIN unset"
        assert f"off ({switch})" in msg, msg
        assert "Fix: Set VLLM_FP4_MOE_PLUGIN to the same value" in msg, msg
        assert "docs/DEPLOYING.md" in msg, msg


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


def test_a_rank_without_the_plugin_ends_the_wait_with_a_named_timeout():
    """Rank 2 has no plugin (its register() never runs): the others name it after
    VLLM_FP4_MOE_PLUGIN_TIMEOUT_S, with what each present rank reported."""
    setups = [{**ON, "timeout_s": 3}, {**ON, "timeout_s": 3},
              {"absent": True, "absent_hold_s": 6}]
    t0 = time.time()
    out = _run(setups)
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetTimeout", msg
        assert "rank(s) 2 of the 3 ranks" in msg and "within 3 s" in msg, msg
        assert "VLLM_FP4_MOE_PLUGIN_TIMEOUT_S" in msg and "not installed there" in msg, msg
        assert msg.count("active (VLLM_FP4_MOE_PLUGIN=1)") == 2, msg
        assert out[rank]["done"] - out[rank]["arrived"] < 3 + 5
    assert out[2]["result"] == ("ok", None)  # it never took part
    assert time.time() - t0 < 200


def test_workers_whose_own_environment_turns_the_switch_off_are_refused():
    """Every rank agrees (all off), but they were launched by a process with the switch on
    (a Ray cluster whose nodes were started with VLLM_FP4_MOE_PLUGIN=0: Ray keeps a worker's
    own value): no rank loads, and the message says where to fix it."""
    launched_off = {"env": {"VLLM_FP4_MOE_PLUGIN": "0", "VLLM_FP4_MOE_PLUGIN_LAUNCHER": "1"}}
    out = _run([launched_off, launched_off])
    for rank in (0, 1):
        kind, msg = out[rank]["result"]
        assert kind == "FleetMismatchError", msg
        assert "ranks 0, 1: started by a process with VLLM_FP4_MOE_PLUGIN=1" in msg, msg
        assert "where `ray start` runs" in msg, msg


def test_disagreement_rules_without_processes():
    from vllm_fp4_moe_plugin.fleet import RankState, disagreement

    on = RankState(0, "0.1.0", "nvfp4_oracle", "active", "1")
    assert disagreement([on, RankState(1, "0.1.0", "nvfp4_oracle", "active", "1")]) is None
    both_off = [RankState(r, "0.1.0", "nvfp4_oracle", "off", "unset") for r in (0, 1)]
    assert disagreement(both_off) is None  # stock everywhere: consistent
    launched_on = [RankState(r, "0.1.0", "nvfp4_oracle", "off", "unset", launcher_on=True)
                   for r in (0, 1)]
    assert "ranks 0, 1: started by a process with VLLM_FP4_MOE_PLUGIN=1" in disagreement(
        launched_on)  # the launcher's switch did not arrive (excluded from Ray's copy)
    msg = disagreement([on, RankState(1, "0.2.0", "modular_method", "active", "1")])
    assert "Install the same vllm-fp4-moe-plugin version" in msg
    assert "Install the same vLLM release" in msg and "Set VLLM_FP4_MOE_PLUGIN" not in msg
