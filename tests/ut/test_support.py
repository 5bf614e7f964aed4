# SPDX-License-Identifier: Apache-2.0
"""The vLLM-free support model: designs by release, EP slices, where each design is wrong."""

import pytest

from vllm_fp4_moe_plugin.base import support


@pytest.mark.parametrize("release, design", [
    ("0.11.0", "init_prepare_finalize"), ("0.11.1", "modular_method"),
    ("0.12.0+cpu", "modular_method"), ("0.13.0", "modular_method"),
    ("0.14.0rc1", "nvfp4_oracle"), ("0.20.0", "nvfp4_oracle"), ("0.34.0", "nvfp4_oracle"),
    ("0.10.2", None),
])
def test_design_for_release(release, design):
    found = support.design_for_release(release)
    assert (found.value if found else None) == design


@pytest.mark.parametrize("bad", ["", "latest", "v0.34"])
def test_release_number_errors_name_the_value(bad):
    with pytest.raises(ValueError, match="not a vLLM release number"):
        support.parse_release(bad)


@pytest.mark.parametrize("backend, sender", [
    ("allgather_reducescatter", True), ("naive", True), ("flashinfer_all2allv", True),
    ("flashinfer_nvlink_two_sided", True), ("flashinfer_nvlink_one_sided", True),
    ("deepep_high_throughput", False), ("deepep_v2", False), ("nixl_ep", False),
    ("deepep_low_latency", False), ("some_future_backend", True),
])
def test_who_quantizes(backend, sender):
    assert support.quantizes_on_sender(backend) is sender


def test_deepep_ll_with_nvfp4_dispatch_quantizes_on_the_sender():
    assert support.quantizes_on_sender("deepep_low_latency", deepep_ll_nvfp4_dispatch=True)


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("dp, ep", [(1, False), (1, True), (2, False), (2, True)])
@pytest.mark.parametrize("eplb", [False, True])
def test_oracle_design_hole(fmt, dp, ep, eplb):
    hole = support.oracle_design_hole(fmt, dp=dp, ep=ep, all2all_backend="allgather_reducescatter",
                                      enable_eplb=eplb, eplb_agrees=True)
    assert hole is (fmt == "compressed-tensors" and dp > 1 and ep and not eplb)


def test_no_hole_without_a_global_scale_backend():
    assert not support.oracle_design_hole("compressed-tensors", dp=2, ep=True,
                                          all2all_backend="allgather_reducescatter",
                                          global_scale_backend=False)


def test_off_by_is_the_ratio_of_the_ranks_maxima():
    amax = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]
    assert support.rank_local_maxima(amax, 2) == [4.0, 8.0]
    assert support.stock_dp_ep_off_by(amax, 2) == 2.0
    assert support.stock_dp_ep_off_by(amax, 1) == 1.0


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("layout", sorted(support.LAYOUTS))
def test_cutlass_routes_hole_is_every_checkpoints_where_an_expert_map_runs(fmt, layout):
    """vLLM's own CUTLASS under EP with the all-gather dispatch (the only EP it takes) reads the
    unzeroed row for non-local routes, whatever the scales; nowhere else, and not once fixed."""
    hole = support.stock_hole("nvfp4_oracle", fmt, layout, "vllm_cutlass",
                              cutlass_reads_workspace=True)
    assert (hole == support.WRONG_ROUTES) is (layout in ("tp_ep", "dp_ep_allgather"))
    assert hole in (support.WRONG_ROUTES, None)
    assert support.stock_hole("nvfp4_oracle", fmt, layout, "vllm_cutlass") is None
    flashinfer = support.stock_hole("nvfp4_oracle", fmt, layout, cutlass_reads_workspace=True)
    assert flashinfer != support.WRONG_ROUTES
