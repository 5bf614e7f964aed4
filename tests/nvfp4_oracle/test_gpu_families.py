# SPDX-License-Identifier: Apache-2.0
"""NVFP4 MoE on the 12.x Blackwell family (RTX PRO 6000 = 12.0), real vLLM code on CPU.

The oracle seam reports the chosen GPU (``simulated_blackwell(capability=...)``) and keeps
vLLM's own device probes, so what vLLM builds there is its decision: FlashInfer CUTLASS takes
9.0, 10.x and 12.x (v0.34.0 FM/experts/flashinfer_cutlass_moe.py:134-146), TRT-LLM the 10.x
family only (FM/experts/trtllm_nvfp4_moe.py:226-234). CUTLASS's GEMM1 scale collapse is vLLM's
Python, asked no capability (Q/utils/flashinfer_fp4_moe.py:496-504), so compressed-tensors under
DP+EP has the same hole on 12.0 as on 10.0, and the plugin must close it there too.
"""

import pytest

from fp4_moe_lab.simulation import blackwell_oracle, oracle_comm, oracle_trtllm
from fp4_moe_lab.simulation.judge import REFUSED
from fp4_moe_lab.simulation.layouts import LAYOUTS, Scenario, run_layout
from fp4_moe_lab.simulation.matrix import rows_for_layout, trtllm_layer_kwargs
from tests.pass_marks import AFFECTED_FACTOR, FP32_FACTOR, PLUGIN_BOUND

RTX_PRO_6000 = "12.0"


def _skip_unless_families() -> None:
    if not blackwell_oracle.simulates_capability(RTX_PRO_6000):
        pytest.skip("this vLLM has no FlashInferExperts._supports_current_device (v0.14.0's "
                    "module-level NVFP4 probes): the seam models 10.0 only there")


def test_an_unknown_capability_is_refused_by_name(capsys):
    from fp4_moe_lab.cli import main

    with pytest.raises(SystemExit) as exited:  # argparse's usage error, before any rank
        main(["matrix", "--capability", "11.0", "--layout", "single"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--capability" in err and "11.0" in err
    for accepted in ("10.0", "10.3", "12.0", "12.1"):
        assert accepted in err, err


def test_the_seam_answers_vllms_probes_as_on_the_gpu():
    """Every capability question reads the reported GPU; the two experts' device probes keep
    vLLM's own family rules (CUTLASS on 12.x, TRT-LLM not)."""
    _skip_unless_families()
    import importlib

    from vllm.platforms import current_platform as p

    # found as the seam finds them (FlashInferExperts moved into fused_moe/experts/ in 0.28.0)
    fx = blackwell_oracle.experts_module()
    trt = importlib.import_module(oracle_trtllm.TRT_EXPERTS)
    FlashInferExperts, TrtLlmNvFp4ExpertsBase = fx.FlashInferExperts, trt.TrtLlmNvFp4ExpertsBase

    with blackwell_oracle.simulated_blackwell(backend="latency", capability=RTX_PRO_6000):
        assert tuple(p.get_device_capability()) == (12, 0)
        assert p.is_device_capability_family(120) and p.has_device_capability(100)
        assert not p.is_device_capability_family(100)
        assert FlashInferExperts._supports_current_device()
        assert not TrtLlmNvFp4ExpertsBase._supports_current_device()
    with blackwell_oracle.simulated_blackwell(backend="latency", capability="10.3"):
        assert TrtLlmNvFp4ExpertsBase._supports_current_device()
    assert p.get_device_capability() is None  # the CPU platform again, once the seam is left


@pytest.mark.multiproc
def test_compressed_tensors_dp_ep_cutlass_hole_on_12_0_and_the_plugin_fix():
    """dp_ep_allgather, FlashInfer CUTLASS, at 12.0: stock far from the ideal NVFP4 answer
    (each rank collapses GEMM1's scale over its own experts), the plugin at it."""
    _skip_unless_families()
    scenario = Scenario()
    fmts = ("compressed-tensors",)
    ranks = run_layout(LAYOUTS["dp_ep_allgather"], scenario, formats=fmts,
                       capability=RTX_PRO_6000)
    for r in ranks:
        for mode in ("stock", "plugin"):
            info = r.info[f"compressed-tensors/{mode}"]
            assert info["backend"] == "FLASHINFER_CUTLASS", info  # vLLM's choice at 12.0
            assert info["experts"] == "FlashInferExperts", info
    (row,) = rows_for_layout("dp_ep_allgather", scenario, fmts, ranks=ranks,
                             capability=RTX_PRO_6000)
    assert row.capability == RTX_PRO_6000 and not row.vllm_refuses
    assert row.stock_error is None and row.plugin_error is None, row
    assert row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
    assert row.stock_fp32_err > FP32_FACTOR * row.noise_floor, row
    assert row.plugin_rel_err <= PLUGIN_BOUND, row
    assert row.plugin_fp32_err <= FP32_FACTOR * row.noise_floor, row
    assert row.ok and row.stock_affected and not row.bit_identical


@pytest.mark.multiproc
def test_vllm_refuses_trtllm_on_12_0_with_and_without_the_plugin():
    """``--moe-backend flashinfer_trtllm`` on 12.0: vLLM's oracle raises at load (the experts'
    device probe says no), stock and plugin alike; the matrix row says so and is ok."""
    _skip_unless_families()
    if not blackwell_oracle.simulates_trtllm():
        pytest.skip("the seam does not simulate this vLLM's TRT-LLM experts")
    scenario = Scenario()
    ranks = run_layout(LAYOUTS["single"], scenario, backend="latency",
                       layer_kwargs=trtllm_layer_kwargs(scenario), capability=RTX_PRO_6000)
    for key, err in ranks[0].errors.items():
        assert err.startswith(REFUSED) and "FLASHINFER_TRTLLM" in err, (key, err)
    assert set(ranks[0].errors) == {f"{f}/{m}" for f in ("modelopt", "compressed-tensors")
                                    for m in ("stock", "plugin")}
    assert not ranks[0].outputs
    rows = rows_for_layout("single", scenario, backend="flashinfer_trtllm", ranks=ranks,
                           capability=RTX_PRO_6000)
    assert all(r.vllm_refuses and r.ok and r.capability == RTX_PRO_6000 for r in rows), rows


#: ``--moe-backend auto`` by GPU family, as vLLM 0.34.0's oracle orders its NVFP4 MoE backends
#: (FM/oracle/nvfp4.py:238-247: TRT-LLM, CuteDSL, CuteDSL-batched, FlashInfer CUTLASS, ...):
#: TRT-LLM on the 10.x family; on 12.x TRT-LLM and CuteDSL need 10.x, so FlashInfer CUTLASS.
AUTO_PICKS = {"10.3": "flashinfer_trtllm", "12.1": "flashinfer_cutlass"}


@pytest.mark.multiproc
@pytest.mark.parametrize("capability", sorted(AUTO_PICKS))
def test_auto_picks_by_family_and_the_plugin_fixes_the_pick(capability):
    """vLLM's own ``--moe-backend auto`` choice on B300 (10.3) and GB10 (12.1), compressed-
    tensors DP+EP: the backend the support model names, with stock's hole there and the plugin
    at the ideal NVFP4 answer."""
    _skip_unless_families()
    if not blackwell_oracle.takes_moe_backend():
        pytest.skip("this vLLM has no --moe-backend (KernelConfig.moe_backend)")
    from fp4_moe_lab.simulation.matrix import auto_pick, run_matrix

    assert auto_pick(capability) == AUTO_PICKS[capability]
    (row,) = run_matrix(["dp_ep_allgather"], formats=("compressed-tensors",),
                        backends=("auto",), capability=capability)
    assert row.backend == f"auto: {AUTO_PICKS[capability]}", row
    assert row.stock_error is None and row.plugin_error is None, row  # vLLM picked it
    assert row.stock_rel_err >= AFFECTED_FACTOR * PLUGIN_BOUND, row
    assert row.plugin_rel_err <= PLUGIN_BOUND and row.ok and row.stock_affected, row


def test_an_auto_row_fails_where_vllm_picked_another_backend():
    """The check behind every auto row: a rank whose oracle chose otherwise loses that output
    and records what vLLM chose."""
    import torch

    from fp4_moe_lab.simulation.layouts import RankOutput
    from fp4_moe_lab.simulation.matrix import _not_the_pick

    out = torch.zeros(2, 4)
    r = RankOutput(rank=0, dp_rank=0,
                   outputs={"modelopt/stock": out, "modelopt/plugin": out},
                   info={"modelopt/stock": {"backend": "FLASHINFER_TRTLLM"},
                         "modelopt/plugin": {"backend": "FLASHINFER_CUTLASS"}})
    _not_the_pick([r], ("modelopt",), "flashinfer_cutlass")
    assert list(r.outputs) == ["modelopt/plugin"]
    assert "vLLM chose flashinfer_trtllm" in r.errors["modelopt/stock"]


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", sorted(blackwell_oracle.B12X_EXPERTS))
def test_vllm_refuses_b12x_under_ep_on_12_0(backend):
    """The two B12X backends (vLLM's ``b12x``, FlashInfer's ``flashinfer_b12x``; 12.x only) take
    no expert parallelism (v0.34.0 FM/b12x.py:537-545, FM/experts/flashinfer_b12x_moe.py:
    214-217): vLLM refuses them at load under DP+EP, stock and plugin alike, for the parallel
    config, so the DP+EP scale hole cannot occur on them. (FlashInfer's collapses GEMM1's
    scale like its other kernels; vLLM's keeps one per expert. Their kernels are not emulated:
    the layouts they take are not run.)"""
    _skip_unless_families()
    module, cls = blackwell_oracle.B12X_EXPERTS[backend]
    if not hasattr(oracle_comm.present_module(module), cls):
        pytest.skip(f"this vLLM has no {module}.{cls} (read on 0.34.0)")
    ranks = run_layout(LAYOUTS["dp_ep_allgather"], Scenario(), backend=backend,
                       capability=RTX_PRO_6000)
    for r in ranks:
        assert set(r.errors) == {f"{f}/{m}" for f in ("modelopt", "compressed-tensors")
                                 for m in ("stock", "plugin")} and not r.outputs
        for key, err in r.errors.items():
            assert err.startswith(REFUSED) and "parallel config" in err, (key, err)
