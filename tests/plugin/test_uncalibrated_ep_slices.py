# SPDX-License-Identifier: Apache-2.0
"""Uncalibrated activation scales judged per layer, not per rank: compressed-tensors sizes a
layer's input scales to the rank's local experts under EP, so each rank sees a slice. Through the
EP group's agreement (one MIN all-reduce at load) every rank repairs with the layer's calibrated
maximum and refuses together, as a single rank holding every expert would (real gloo ranks)."""

import math
import multiprocessing as mp
import socket

import pytest

pytestmark = pytest.mark.multiproc

# compressed-tensors input_global_scale (2688 / amax) of a 4-expert layer over 2 ranks
CALIBRATED = [300.0, 250.0]
DEAD = [1.57e-29, 0.0]  # llmcompressor's no-statistics values (gate/up, down_proj)
FAR = [300.0 / 1e5, 300.0 / 1e5]  # plausible, but 1e5x the other slice's amax


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, slices, queue) -> None:
    import torch
    import torch.distributed as dist

    from vllm_fp4_moe_plugin.scales import layer_scales

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        stored = torch.tensor(slices[rank])
        try:
            out = layer_scales.repair_uncalibrated(
                stored, reciprocal=True, layer="model.layers.2.mlp.experts",
                name="w13_input_global_scale", group=dist.group.WORLD)
            queue.put((rank, out.tolist()))
        except layer_scales.InvalidScaleError as exc:
            queue.put((rank, f"{type(exc).__name__}: {exc}"))
    finally:
        dist.destroy_process_group()


def _run(slices) -> dict:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _free_port()
    procs = [ctx.Process(target=_rank, args=(r, len(slices), port, slices, queue))
             for r in range(len(slices))]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return out


def test_a_rank_whose_experts_are_all_dead_gets_the_layers_calibrated_max():
    """Rank 1 holds only dead experts: alone it has nothing to fall back on; with the group it
    loads the layer's calibrated max amax (the smallest stored global scale, 250), as one rank
    holding all four experts does."""
    out = _run([CALIBRATED, DEAD])
    assert out[0] == CALIBRATED
    assert out[1] == [250.0, 250.0]


def test_half_the_layer_dead_leaves_every_calibrated_expert_alone():
    out = _run([[CALIBRATED[0], DEAD[0]], [DEAD[1], CALIBRATED[1]]])
    assert out[0] == [300.0, 250.0] and out[1] == [250.0, 250.0]


def test_clusters_on_different_ranks_are_refused_on_every_rank():
    """Each slice alone looks calibrated; the layer's spans 1e5x: both ranks refuse, naming it."""
    out = _run([CALIBRATED, FAR])
    for rank in (0, 1):
        assert out[rank].startswith("IndistinguishableScalesError"), out[rank]
        assert "model.layers.2.mlp.experts" in out[rank] and "cannot be told apart" in out[rank]


def test_no_calibrated_expert_anywhere_is_refused_on_every_rank():
    out = _run([DEAD, [math.nan, -127.6]])
    assert all("nothing to fall back on" in out[r] for r in (0, 1)), out
