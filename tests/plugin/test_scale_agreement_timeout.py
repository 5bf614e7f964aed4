"""The load-time MIN agreement cannot hang forever (issue #14): a rank that never arrives is
named, with the layer, after the timeout."""

import multiprocessing as mp
import socket

import pytest

pytestmark = [pytest.mark.cpu, pytest.mark.multiproc]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, absent: int, queue) -> None:
    import time

    import torch
    import torch.distributed as dist

    from vllm_fp4_moe_plugin import scales

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        if rank == absent:  # stuck elsewhere (still loading, or diverged)
            time.sleep(8)
            queue.put((rank, "absent"))
            return
        try:
            g = scales.agree_min_scale(torch.tensor([2.0, 1.0 + rank]), dist.group.WORLD,
                                       layer="model.layers.7.mlp.experts", timeout_s=2)
            queue.put((rank, f"agreed {float(g)}"))
        except scales.ScaleAgreementTimeout as exc:
            queue.put((rank, str(exc)))
    finally:
        dist.destroy_process_group()


def _run(world: int, absent: int) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, absent, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return out


def test_all_ranks_present_agree_on_the_min():
    out = _run(world=2, absent=-1)
    assert out == {0: "agreed 1.0", 1: "agreed 1.0"}


def test_a_rank_that_never_arrives_is_named_with_the_layer():
    out = _run(world=3, absent=2)
    msg = out[0]  # rank 0 of the group monitors the others
    assert "model.layers.7.mlp.experts" in msg and "timed out after 2 s" in msg, msg
    assert "Ranks 2 failed to pass" in msg, msg  # the rank that did not answer, named
    assert out[2] == "absent"
