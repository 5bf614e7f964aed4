# SPDX-License-Identifier: Apache-2.0
"""Llama-4's router weight on the input counted once (``patches/router_weight_once.py``), in each
release world this folder runs in (vLLM 0.11.0, 0.12.0, 0.34.0: scripts/test.sh): what its
findings read from the installed vLLM, the plan they give, the wrapper against each of the
installed vLLM's prepare classes, and the layer itself (``matrix --router-weight-on-input``: the
real Llama-4 MoE layer, top-1, against the reference that applies the weight once)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch

from tests import pass_marks
from vllm_fp4_moe_plugin.base import vllm_modules as vm
from vllm_fp4_moe_plugin.patches import compat, ledger
from vllm_fp4_moe_plugin.patches import router_weight_once as rw

OBSERVED = compat.probe()
FINDINGS = OBSERVED.findings
# The prepare/finalize classes the installed vLLM may have, and whether each scales its input by
# the router weight under the flag (read here from each release's source, by hand).
_FM = vm.FUSED_MOE
def _class_or_none(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:  # a module of another release
        return None


PREPARES = [(m, c, applies) for m, c, applies in (
    (f"{_FM}.prepare_finalize.no_dp_ep", "MoEPrepareAndFinalizeNoDPEPModular", True),  # 0.32+
    (f"{_FM}.prepare_finalize.naive_dp_ep", "MoEPrepareAndFinalizeNaiveDPEPModular", True),
    (f"{_FM}.prepare_finalize.passthrough", "PassThroughPrepareAndFinalize", False),
    (f"{_FM}.prepare_finalize", "MoEPrepareAndFinalizeNoEP", True),  # up to 0.13
    (vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllGatherMoEPrepareAndFinalize", True),
    (vm.FLASHINFER_CUTLASS_PREPARE_FINALIZE, "FlashInferAllToAllMoEPrepareAndFinalize", True),
) if _class_or_none(m, c) is not None]


def _experts_call() -> str:
    """Read independently of the probe: the modular kernel's method that calls the experts with
    the router weights (0.11.0 has no ``_fused_experts``; its chunking helper does that)."""
    module = importlib.import_module(rw.MODULAR_KERNEL)
    for cls in ("FusedMoEKernelModularImpl", "FusedMoEModularKernel"):
        kernel = getattr(module, cls, None)
        for method in ("_fused_experts", "_maybe_chunk_fused_experts"):
            if hasattr(kernel, method):
                return f"{cls}.{method}"
    return ""


def test_the_findings_read_the_installed_vllm():
    assert FINDINGS["experts_call"] == _experts_call() != ""
    # FlashInfer's CUTLASS experts hand the kernel token_final_scales=topk_weights whatever the
    # flag, in every release 0.11.0-0.34.0
    assert FINDINGS["nvfp4_experts_weight_again"] is True
    # 0.11.0, 0.12.0: the DP-chunked forward drops the on-input flag forward_impl passes; 0.34.0:
    # gone (0.13.0, not a world here, reads the flag from the layer in apply: false there)
    fused_moe = importlib.import_module(rw.FUSED_MOE_LAYER)
    chunked = hasattr(getattr(fused_moe, "FusedMoE", None), "forward_impl_chunked")
    assert FINDINGS["dp_chunked_drops_flag"] is chunked
    # 0.11.0, 0.12.0: a prepare scales its input in place (a1.mul_) in front of
    # FusedMoEModularKernel.forward, where the shared expert runs; 0.34.0 scales a copy
    assert FINDINGS["prepare_scales_in_place"] is chunked


def test_the_plan_applies_it_exactly_where_vllm_has_the_hook():
    plan = ledger.plan(OBSERVED)
    call = FINDINGS["experts_call"]
    ours = [t for t in plan.patches if t.startswith(rw.MODULAR_KERNEL + ".")]
    shared = [f"{rw.MODULAR_KERNEL}.FusedMoEModularKernel.forward"] if (
        FINDINGS["prepare_scales_in_place"]) else []
    assert ours == [f"{rw.MODULAR_KERNEL}.{call}"] + shared, plan.patches
    chunked = [t for t in plan.patches if t.endswith(".forward_impl_chunked")]
    assert bool(chunked) == FINDINGS["dp_chunked_drops_flag"], plan.patches
    assert rw.WORDS in plan.reason, plan.reason


def test_the_installed_vllm_has_prepares_to_check():
    assert [c for _, c, applies in PREPARES if applies], PREPARES


@pytest.mark.parametrize("module, cls, applies", PREPARES, ids=[c for _, c, _ in PREPARES])
def test_which_prepares_apply_the_weight(module, cls, applies):
    assert rw.prepare_applies_weight(getattr(importlib.import_module(module), cls)) is applies


def _kernel(prepare_cls, quant_dtype):
    kernel = SimpleNamespace(prepare_finalize=object.__new__(prepare_cls),
                             fused_experts=SimpleNamespace(
                                 quant_config=SimpleNamespace(quant_dtype=quant_dtype)))
    seen = {}

    def original(self, *, topk_weights, apply_router_weight_on_input, **rest):
        seen["topk_weights"] = topk_weights
        return "out"

    return kernel, rw.build(original), seen


def _cases():
    out = []
    for module, cls, applies in PREPARES:
        prepare = getattr(importlib.import_module(module), cls)
        out.append((prepare, "nvfp4", True, applies))  # Llama-4: unit weights iff applied
        out.append((prepare, "nvfp4", False, False))  # every other model: untouched
        out.append((prepare, torch.float8_e4m3fn, True, False))  # not NVFP4: not ours
    return out


@pytest.mark.parametrize("prepare_cls, quant_dtype, on_input, unit", _cases(),
                         ids=lambda v: getattr(v, "__name__", str(v)))
def test_experts_get_unit_weights_only_where_the_prepare_weighted(prepare_cls, quant_dtype,
                                                                   on_input, unit):
    kernel, wrapped, seen = _kernel(prepare_cls, quant_dtype)
    weights = torch.tensor([[0.25], [0.75]])
    assert wrapped(kernel, topk_weights=weights, apply_router_weight_on_input=on_input) == "out"
    if unit:
        torch.testing.assert_close(seen["topk_weights"], torch.ones_like(weights))
    else:
        assert seen["topk_weights"] is weights
    torch.testing.assert_close(weights, torch.tensor([[0.25], [0.75]]))  # the finalize's own


class _Copy(torch.nn.Module):
    def forward(self, x):
        return x.clone()


class _Kernel(torch.nn.Module):
    """``FusedMoEModularKernel.forward``'s signature (v0110, v0120 modular_kernel.py), and what
    it does with a shared expert: the prepare scales ``a1`` in place, then the shared experts
    run on ``a1`` (v0110 modular_kernel.py:1001-1014)."""

    def __init__(self, shared, quant_dtype="nvfp4"):
        super().__init__()
        self.shared_experts = shared
        self.fused_experts = SimpleNamespace(quant_config=SimpleNamespace(quant_dtype=quant_dtype))

    def forward(self, hidden_states, w1, w2, topk_weights, topk_ids, inplace=False,
                activation="silu", global_num_experts=-1, expert_map=None,
                apply_router_weight_on_input=False):
        if apply_router_weight_on_input:
            hidden_states.mul_(topk_weights)
        return None if self.shared_experts is None else self.shared_experts(hidden_states)


@pytest.mark.parametrize("by_keyword", [True, False])
def test_the_shared_expert_gets_the_input_as_it_came(by_keyword):
    forward = rw.build_shared_input(_Kernel.forward)
    x, w = torch.tensor([[2.0, 4.0], [6.0, 8.0]]), torch.tensor([[0.25], [0.5]])
    kernel = _Kernel(_Copy())
    shared = kernel.shared_experts
    flag = {"apply_router_weight_on_input": True} if by_keyword else {}

    def args():  # the flag by keyword, as vLLM passes it, or by position
        return (x.clone(), None, None, w, None) + (() if by_keyword else (
            False, "silu", -1, None, True))

    torch.testing.assert_close(_Kernel.forward(kernel, *args(), **flag), x * w)  # stock
    torch.testing.assert_close(forward(kernel, *args(), **flag), x)
    assert kernel.shared_experts is shared and "shared_experts" not in vars(kernel)
    # without the flag, without a shared expert, or not NVFP4: vLLM's own call, untouched
    torch.testing.assert_close(forward(kernel, x.clone(), None, None, w, None), x)
    assert forward(_Kernel(None), *args(), **flag) is None
    fp8 = _Kernel(_Copy(), torch.float8_e4m3fn)
    torch.testing.assert_close(forward(fp8, *args(), **flag), x * w)


@pytest.mark.slow
@pytest.mark.multiproc
def test_the_layer_weights_each_token_once():
    """Llama-4's MoE, its shared expert included: stock weights each routed token twice (and
    on 0.11.0-0.15.1 hands the shared expert the weighted input), far from the reference that
    applies the weight once; the plugin is at it, on every layout kind and each kernel that
    weights again (vLLM's CUTLASS from 0.32.0, under EP; TRT-LLM's modular experts under DP+EP
    on the oracle design), in each release world (0.11.0: through
    the chunking helper; 0.11.0 and 0.12.0 under DP: with the flag the chunked forward
    drops)."""
    from fp4_moe_lab.simulation.layouts import Scenario
    from fp4_moe_lab.simulation.matrix import run_matrix
    from vllm_fp4_moe_plugin.base.support import LAYOUTS

    backends = ("flashinfer_cutlass",) + (
        ("vllm_cutlass",) if FINDINGS.get("cutlass_fp4_takes_expert_map") else ())
    llama4 = Scenario(router_weight_on_input=True, top_k=1, shared_expert=True)
    rows = [r.as_dict() for r in run_matrix(
        layouts=("single", "tp_ep", "dp_ep_allgather"), backends=backends, scenario=llama4)]
    assert len(rows) == 3 * 2 * len(backends)
    if FINDINGS.get("nvfp4_oracle"):  # TRT-LLM's modular experts, which DP+EP runs
        rows += [r.as_dict() for r in run_matrix(
            layouts=("dp_ep_allgather",), backends=("flashinfer_trtllm",), scenario=llama4)]
        assert len(rows) == 3 * 2 * len(backends) + 2
    for r in rows:
        assert r["plugin_error"] is None and r["stock_error"] is None, r
        assert r["stock_rel_err"] >= 0.2, r  # every token off by its router weight
        tol = pass_marks.router_weight_once(LAYOUTS[r["layout"]].tp)  # the reference
        assert r["ok"] and r["plugin_rel_err"] <= tol, r


def test_doctor_follows_the_fix_on_a_llama4_checkpoint(tmp_path, blackwell_env):
    """On FlashInfer CUTLASS (measured in each world by the test above) ``doctor`` says AT RISK
    for a Llama-4 checkpoint with the plugin off, naming the switch, and FINE with it on."""
    from tests.checkpoint.synthetic import write_scales_only
    from vllm_fp4_moe_plugin.tools import doctor

    experts = 8
    write_scales_only(tmp_path, "modelopt", {
        "language_model.model.layers.0.feed_forward.experts": ([0.25] * experts,
                                                               [16.0] * experts)},
        projs=("gate_proj", "up_proj", "down_proj"),
        config={"architectures": ["Llama4ForConditionalGeneration"], "model_type": "llama4",
                "text_config": {"num_local_experts": experts, "model_type": "llama4_text"}})
    blackwell_env.setenv("VLLM_FLASHINFER_MOE_BACKEND", "throughput")  # CUTLASS before 0.20.0

    def run():
        return doctor.run_doctor(str(tmp_path), doctor.deployed_layout(tp=2, ep=True),
                                 capability="10.0", moe_backend="flashinfer_cutlass")

    r = run()
    assert r["layout"]["kernel"] == "flashinfer_cutlass", r["layout"]
    assert r["verdict"] == doctor.AT_RISK
    assert any("a second time" in w and "VLLM_FP4_MOE_PLUGIN=1" in w for w in r["reasons"]), \
        r["reasons"]
    blackwell_env.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    r = run()
    assert r["verdict"] == doctor.FINE, r["reasons"]


def test_the_cost_benchmark_runs_here(tmp_path):
    """benchmarks/router_weight.py (benchmarks/RESULTS.md item 10) times each entry's wrapper
    in this world: one row per site, flag and token count, every time finite."""
    import json
    import math
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "router_weight.json"
    subprocess.run([sys.executable, "-m", "benchmarks.router_weight", "--tokens", "1", "64",
                    "--repeat", "3", "--json", str(out)], check=True, capture_output=True,
                   cwd=Path(__file__).resolve().parents[2], timeout=300)
    rows = json.loads(out.read_text())["rows"]
    sites = [(r["site"], r["on_input"], r["tokens"]) for r in rows]
    assert sites == [("experts_call", f, m) for m in (1, 64) for f in (False, True)] + [
        ("kernel_forward", f, m) for m in (1, 64) for f in (False, True)] + [
        ("forward_impl_chunked", f, None) for f in (False, True)]
    assert all(math.isfinite(r["stock_us"]) and math.isfinite(r["patched_us"]) for r in rows)
