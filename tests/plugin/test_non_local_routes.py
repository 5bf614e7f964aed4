# SPDX-License-Identifier: Apache-2.0
"""vLLM CUTLASS's route fix (patches/nvfp4_oracle/non_local_routes.py) against the contract of
``run_cutlass_moe_fp4`` (v0.34.0 FM/experts/cutlass_moe.py:511-705): GEMM1 writes its output
into ``workspace13`` as ``[m * topk, w1_n]``, GEMM2 writes the local routes' rows of the same
memory as ``[m * topk, k]``, and every non-local route reads row ``expert_offsets[E]`` (the
number of local routes), which nobody writes. The stand-in below keeps exactly that contract,
so generated shapes, routes and expert maps run here in torch alone; the real function under
the seam: tests/nvfp4_oracle/test_vllm_cutlass.py."""

import random

import pytest
import torch

from vllm_fp4_moe_plugin.patches.nvfp4_oracle import non_local_routes

GEMM1_VALUE, GEMM2_VALUE = 2.0**14, 1.0  # what the stand-in's GEMMs write: finite, recognisable


def run_cutlass_moe_fp4(output, a, a1_gscale, w1_fp4, w1_blockscale, w1_alphas, a2_gscale,
                        w2_fp4, w2_blockscale, w2_alphas, topk_weights, topk_ids, activation,
                        workspace13, workspace2, m, n, k, e, device,
                        apply_router_weight_on_input=False, expert_map=None, *,
                        activation_config=None):
    """The contract, in torch: route sort, GEMM1 into workspace13, GEMM2 into the local rows
    of the same memory, the gather by ``c_map``, the weighted sum."""
    local_ids = torch.where(topk_ids >= 0, expert_map[topk_ids.clamp(min=0).long()], -1)
    flat = local_ids.flatten().tolist()
    order = [i for x in range(e) for i, t in enumerate(flat) if t == x]
    c_map = [len(order)] * len(flat)
    for row, i in enumerate(order):
        c_map[i] = row
    routes, w1_n = len(flat), 2 * n
    if apply_router_weight_on_input:
        a.mul_(topk_weights.to(a.dtype))
    workspace13.view(-1)[: routes * w1_n].view(routes, w1_n)[: len(order)] = GEMM1_VALUE
    c3 = workspace13.view(-1)[: routes * k].view(routes, k)
    c3[: len(order)] = GEMM2_VALUE
    c3 = c3[torch.tensor(c_map)]
    if apply_router_weight_on_input:
        output.copy_(c3.view(m, -1, k).sum(dim=1))
    else:
        output.copy_((c3.view(m, -1, k) * topk_weights.view(m, -1, 1).to(output.dtype))
                     .sum(dim=1))


def _case(rng: random.Random, top1: bool = False):
    e_global = rng.choice([2, 4, 8])
    topk = 1 if top1 else rng.randint(1, min(4, e_global))
    m, n, k = rng.randint(1, 9), rng.choice([8, 16, 64]), rng.choice([16, 32, 64])
    owned = sorted(rng.sample(range(e_global), rng.randint(1, e_global - 1)))
    expert_map = torch.full((e_global,), -1, dtype=torch.int32)
    expert_map[owned] = torch.arange(len(owned), dtype=torch.int32)
    ids = torch.tensor([rng.sample(range(e_global), topk) for _ in range(m)], dtype=torch.int32)
    weights = torch.rand(m, topk, generator=torch.Generator().manual_seed(rng.randrange(2**31)))
    return dict(m=m, n=n, k=k, e=len(owned), topk_ids=ids, topk_weights=weights,
                expert_map=expert_map)


def _call(case, fn, *, on_input=False, fill=float("nan")):
    m, n, k, topk = case["m"], case["n"], case["k"], case["topk_ids"].size(1)
    out = torch.full((m, k), fill, dtype=torch.bfloat16)
    workspace13 = torch.full((m * topk, max(2 * n, k)), fill, dtype=torch.bfloat16)
    fn(output=out, a=torch.ones(m, k, dtype=torch.bfloat16), a1_gscale=None, w1_fp4=None,
       w1_blockscale=None, w1_alphas=None, a2_gscale=None, w2_fp4=None, w2_blockscale=None,
       w2_alphas=None, topk_weights=case["topk_weights"], topk_ids=case["topk_ids"],
       activation=None, workspace13=workspace13,
       workspace2=torch.full((m * topk, n), fill, dtype=torch.bfloat16), m=m, n=n, k=k,
       e=case["e"], device=torch.device("cpu"), apply_router_weight_on_input=on_input,
       expert_map=case["expert_map"])
    return out.float(), workspace13


def _want(case, on_input=False):
    local = non_local_routes.local_routes(case["topk_ids"], case["expert_map"])
    w = torch.ones_like(case["topk_weights"]) if on_input else case["topk_weights"]
    per_token = (w.to(torch.bfloat16).float() * local).sum(dim=1)
    return per_token.reshape(-1, 1).expand(-1, case["k"]) * GEMM2_VALUE


@pytest.mark.parametrize("seed", range(40))
def test_non_local_routes_add_nothing_on_a_poisoned_workspace(seed):
    """Stock reads NaN (or GEMM1's output) for a non-local route; the wrapper gives every token
    exactly its local routes' weighted rows, whatever the shape puts under the read row."""
    rng = random.Random(seed)
    case = _case(rng)
    local = non_local_routes.local_routes(case["topk_ids"], case["expert_map"])
    stock, _ = _call(case, run_cutlass_moe_fp4)
    fixed, _ = _call(case, non_local_routes.build(run_cutlass_moe_fp4))
    torch.testing.assert_close(fixed, _want(case), rtol=1e-2, atol=1e-2)
    if not bool(local.all()):  # stock is wrong exactly for tokens with a non-local route
        hit = ~local.all(dim=1)
        assert not torch.isfinite(stock[hit]).all() or (stock[hit] != fixed[hit]).any()


@pytest.mark.parametrize("seed", range(10))
def test_router_weight_on_input_top1(seed):
    case = _case(random.Random(1000 + seed), top1=True)
    fixed, _ = _call(case, non_local_routes.build(run_cutlass_moe_fp4), on_input=True)
    local = non_local_routes.local_routes(case["topk_ids"], case["expert_map"])[:, 0]
    assert torch.equal(fixed[~local], torch.zeros_like(fixed[~local]))
    assert torch.isfinite(fixed).all()


def test_the_row_lies_where_gemm1_wrote():
    """hidden < 2 * intermediate: the read row holds GEMM1's output, finite but not zero; the
    route's weight 0 still makes it add nothing (stock: weight x GEMM1's value)."""
    case = dict(m=2, n=64, k=32, e=1, topk_ids=torch.tensor([[0], [1]], dtype=torch.int32),
                topk_weights=torch.tensor([[0.5], [0.5]]),
                expert_map=torch.tensor([0, -1], dtype=torch.int32))
    stock, _ = _call(case, run_cutlass_moe_fp4, fill=0.0)
    fixed, _ = _call(case, non_local_routes.build(run_cutlass_moe_fp4), fill=0.0)
    assert bool((stock[1] == 0.5 * GEMM1_VALUE).all())
    assert torch.equal(fixed[1], torch.zeros(32)) and bool((fixed[0] == 0.5).all())


@pytest.mark.parametrize("seed", range(20))
def test_the_wrapper_writes_one_row_of_the_workspace(seed):
    """What the wrapper adds per call: ``k`` elements of workspace13 (one row), never the
    ``m x topk x k`` region; no host sync (the row index is a tensor)."""
    case = _case(random.Random(2000 + seed))
    seen = {}

    def original(**call):
        seen.update(call)

    _, ws = _call(case, non_local_routes.build(original))
    assert int(torch.isnan(ws).logical_not().sum()) == case["k"]
    local = non_local_routes.local_routes(case["topk_ids"], case["expert_map"])
    routes, k = local.numel(), case["k"]
    row = min(int(local.sum()), routes - 1)
    assert torch.equal(ws.view(-1)[row * k:(row + 1) * k], torch.zeros(k, dtype=ws.dtype))
    masked = 2 * case["n"] > k  # only where GEMM1's output can reach the row
    want = torch.where(local, case["topk_weights"], 0.0) if masked else case["topk_weights"]
    assert torch.equal(seen["topk_weights"], want)


def test_no_expert_map_is_the_original_call():
    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "stock"

    wrapped = non_local_routes.build(original)
    assert wrapped(1, 2, expert_map=None) == "stock" and calls == [((1, 2), {"expert_map": None})]


def test_positional_arguments_reach_the_same_call():
    case = _case(random.Random(7))
    fixed_kw, _ = _call(case, non_local_routes.build(run_cutlass_moe_fp4))
    m, n, k, topk = case["m"], case["n"], case["k"], case["topk_ids"].size(1)
    out = torch.full((m, k), float("nan"), dtype=torch.bfloat16)
    non_local_routes.build(run_cutlass_moe_fp4)(
        out, torch.ones(m, k, dtype=torch.bfloat16), None, None, None, None, None, None, None,
        None, case["topk_weights"], case["topk_ids"], None,
        torch.full((m * topk, max(2 * n, k)), float("nan"), dtype=torch.bfloat16),
        torch.full((m * topk, n), float("nan"), dtype=torch.bfloat16), m, n, k, case["e"],
        torch.device("cpu"), False, case["expert_map"])
    assert torch.equal(out.float(), fixed_kw)


def test_the_benchmark_measures_both_forms(tmp_path):
    """benchmarks/route_fix.py (item 9) runs here and counts what each form writes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "route_fix.json"
    subprocess.run([sys.executable, "-m", "benchmarks.route_fix", "--tokens", "1", "64",
                    "--repeat", "1", "--json", str(out)], check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parents[2], timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert [r["tokens"] for r in rows] == [1, 64]
    big = rows[1]
    assert big["first_bytes"] == 64 * 8 * 7168 * 2 + 64 * 8 * 5
    assert big["now_bytes"] == 7168 * 2 + 64 * 8 + 8
    assert all(r["now_us"] > 0 and r["first_us"] > 0 for r in rows)
