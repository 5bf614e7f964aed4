# SPDX-License-Identifier: Apache-2.0
"""The load-time scale agreement is one collective per layer and cannot hang forever: a rank
that never arrives is named, with the layer and how far it got, after the timeout."""

import multiprocessing as mp
import socket

import pytest

pytestmark = pytest.mark.multiproc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, absent: int, queue) -> None:
    import time

    import torch
    import torch.distributed as dist

    from vllm_fp4_moe_plugin.scales import scale_agreement

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        # every rank agrees on layer 3 (min and max in one collective)...
        lo, hi = scale_agreement.agree_min_max(torch.tensor([2.0, 1.0 + rank]), dist.group.WORLD,
                                      layer="model.layers.3.mlp.experts", timeout_s=30)
        if rank == absent:  # ...then one is stuck elsewhere (still loading, or diverged)
            time.sleep(8)
            queue.put((rank, "absent"))
            return
        try:
            g = scale_agreement.agree_min_scale(torch.tensor([2.0, 1.0 + rank]), dist.group.WORLD,
                                       layer="model.layers.7.mlp.experts", timeout_s=2)
            m = scale_agreement.agree_max(torch.tensor([2.0, 1.0 + rank]), dist.group.WORLD,
                                 layer="model.layers.7.mlp.experts", timeout_s=2)
            queue.put((rank, f"agreed {float(g)} {float(m)} {float(lo)} {float(hi)}"))
        except scale_agreement.ScaleAgreementTimeout as exc:
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
    assert out == {0: "agreed 1.0 2.0 1.0 2.0", 1: "agreed 1.0 2.0 1.0 2.0"}


def test_a_rank_that_never_arrives_is_named_with_the_layer():
    out = _run(world=3, absent=2)
    for rank in (0, 1):  # every rank that waited names the one that is behind
        msg = out[rank]
        assert "model.layers.7.mlp.experts" in msg and "timed out after 2 s" in msg, msg
        assert "VLLM_FP4_MOE_PLUGIN_TIMEOUT_S" in msg, msg
        assert ("rank 2 reached 1 of this rank's 2 agreements (last: model.layers.3.mlp.experts)"
                in msg), msg
        assert "rank 0 reached" not in msg and "rank 1 reached" not in msg, msg
    assert out[2] == "absent"
