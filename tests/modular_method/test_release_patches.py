# SPDX-License-Identifier: Apache-2.0
"""On a 0.11.1-era vLLM the plugin installs only the fixes upstream still lacks.

ModelOpt's GEMM1 scales were fixed upstream (#27223/#26135); the plugin's ModelOpt entry there
only repairs dead or missing expert scales, as a same-named subclass: vLLM 0.11.1's weight loader
gates the global input-scale load on the class *name* ``ModelOptNvFp4FusedMoE`` (layer.py:968
there; v0120 layer.py:1140), and a renamed or re-wrapped class would silently load only local
rows. The plugin's every-design entry (vLLM's env registry) is not this design's.
"""

import importlib

import pytest

from tests.design_gate import one_module_targets
from vllm_fp4_moe_plugin.base.support import Design
from vllm_fp4_moe_plugin.patches import compat, ledger
from vllm_fp4_moe_plugin.patches.modular_method import probe as mm_probe

pytestmark = pytest.mark.compat

_MO = "vllm.model_executor.layers.quantization.modelopt"
_CT = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
_PF = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_prepare_finalize"
_FX = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe"
_UNTOUCHED = ((_FX, "flashinfer_cutlass_moe_fp4"),
              (_FX, "FlashInferExperts"), (_PF, "FlashInferAllGatherMoEPrepareAndFinalize"),
              ("vllm.model_executor.layers.fused_moe.layer", "FusedMoE"))


def _get(module, attr):
    return getattr(importlib.import_module(module), attr)


def test_probe_sees_the_0_11_1_design_and_its_two_holes():
    result = ledger.plan()
    ct = mm_probe.compressed_tensors_nvfp4_class_name()
    assert result.install and result.design == "modular_method", result.reason
    assert result.findings["tp_fix_present"] and result.findings["modelopt_dp_fix_present"]
    expected = {f"{_CT}.{ct}", f"{_MO}.ModelOptNvFp4FusedMoE",
                f"{_PF}.FlashInferAllToAllMoEPrepareAndFinalize"}
    if result.findings.get("modelopt_method_cls_attr"):
        # 0.12.0 creates ModelOpt's method from a class attribute bound at import.
        expected.add(f"{_MO}.ModelOptNvFp4Config.FusedMoEMethodCls")
    assert set(result.patches) == expected | one_module_targets(compat.probe())


def test_register_leaves_upstream_fixed_symbols_alone(fresh_plugin, monkeypatch, caplog_plugin):
    before = {t: _get(*t) for t in _UNTOUCHED}
    ct_name = mm_probe.compressed_tensors_nvfp4_class_name()
    ct_before = _get(_CT, ct_name)
    mo_before = _get(_MO, "ModelOptNvFp4FusedMoE")
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    assert fresh_plugin.state()[0] == "active"
    for target, obj in before.items():
        assert _get(*target) is obj, f"{'.'.join(target)} was replaced"
    for module, name, old in ((_MO, "ModelOptNvFp4FusedMoE", mo_before), (_CT, ct_name, ct_before)):
        new = _get(module, name)
        assert new is not old and new.__name__ == name and issubclass(new, old)
    config = _get(_MO, "ModelOptNvFp4Config")
    if "FusedMoEMethodCls" in vars(config):
        assert config.FusedMoEMethodCls is _get(_MO, "ModelOptNvFp4FusedMoE")
    every_design = {p.target for p in ledger.EVERY_DESIGN}
    assert sorted(set(ledger.applied_targets()) - every_design) == sorted(ledger.plan().patches)
    lines = [r.getMessage() for r in caplog_plugin.records if "plugin active" in r.getMessage()]
    assert len(lines) == 1 and "ModelOptNvFp4FusedMoE" in lines[0]


def test_no_0_11_0_patch_applies_on_this_design(fresh_plugin, monkeypatch):
    """0.11.1 keeps the compressed-tensors class name of 0.11.0, so the targets can coincide:
    what is installed must be built by this design's ledger entries."""
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    ours = {p.build.partition(":")[0] for p in ledger.entries_for_design(Design.MODULAR_METHOD)}
    assert "vllm_fp4_moe_plugin.patches.modular_method.compressed_tensors_dp" in ours
    every_design = {p.target for p in ledger.EVERY_DESIGN}
    for target in set(ledger.applied_targets()) - every_design:
        entry = next(p for p in ledger.LEDGER if p.target == target)
        value = importlib.import_module(entry.module)
        for part in entry.attr.split("."):  # a class attribute too (ModelOptNvFp4Config's)
            value = getattr(value, part)
        assert value.__module__ in ours, target
    assert not any(t.endswith("flashinfer_cutlass_moe_fp4") for t in ledger.applied_targets())


def test_all2allv_probe_flips_once_patched(fresh_plugin, monkeypatch):
    assert mm_probe.all2allv_tp_prequantizes()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    import torch
    from vllm.model_executor.layers.fused_moe.config import nvfp4_moe_quant_config

    one = torch.ones(1)
    cfg = nvfp4_moe_quant_config(g1_alphas=one, g2_alphas=one, a1_gscale=one, a2_gscale=one,
                                 w1_scale=one, w2_scale=one)
    a1 = torch.zeros(2, 32, dtype=torch.bfloat16)
    pf = _get(_PF, "FlashInferAllToAllMoEPrepareAndFinalize")(use_dp=False)
    out = pf.prepare(a1, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32), 2, None, False,
                     cfg)
    assert out[0] is a1 and out[1] is None
    # The probe looks through our own patch: doctor still reports the upstream hole.
    assert mm_probe.all2allv_tp_prequantizes()


def test_compressed_tensors_without_backend_attribute_means_cutlass():
    """0.11.1/0.11.2's compressed-tensors method has no ``flashinfer_moe_backend`` (it has no
    TRT-LLM path): FlashInfer there is CUTLASS, so the DP fix must still apply. (Found by the
    matrix run on 0.11.1, where it first did not.)"""
    from vllm.model_executor.layers.quantization.utils.flashinfer_utils import FlashinferMoeBackend

    from vllm_fp4_moe_plugin.patches.modular_method.compressed_tensors_dp import (
        SharedGemm1ScaleForDpMixin,
    )

    method = object.__new__(SharedGemm1ScaleForDpMixin)
    method.allow_flashinfer, method.use_marlin = True, False
    assert method._fp4_uses_cutlass()
    method.flashinfer_moe_backend = FlashinferMoeBackend.TENSORRT_LLM
    assert not method._fp4_uses_cutlass()
    method.flashinfer_moe_backend, method.use_marlin = FlashinferMoeBackend.CUTLASS, True
    assert not method._fp4_uses_cutlass()


@pytest.mark.multiproc
def test_off_warning_only_where_this_release_is_wrong():
    """Switch unset: the one WARNING fires for compressed-tensors under DP dispatch (the hole
    left open), not for TP-like layouts, which 0.11.1 computes right."""
    from fp4_moe_lab.simulation.layouts import LAYOUTS, spawn

    single = spawn(LAYOUTS["single"], "tests.layer_jobs:off_warning")[0]
    assert single["unset/4.0"] == [], single
    dp = spawn(LAYOUTS["dp"], "tests.layer_jobs:off_warning")[0]
    assert len(dp["unset/4.0"]) == 1 and "data-parallel dispatch" in dp["unset/4.0"][0]
    assert dp["unset/1.0"] == [] and dp["0/4.0"] == []


def test_the_probe_reports_exactly_the_declared_findings():
    obs = compat.probe()
    # Reference check: the keys tests/ut/test_ledger.py checks every predicate against.
    assert obs.patchable and set(obs.findings) == set(compat.FINDINGS[obs.design]), obs


def test_compressed_tensors_dp_probe_sees_the_hole_and_would_see_a_fix(monkeypatch):
    """P5 runs the method's own process_weights_after_loading on experts whose input scales
    differ: this release keeps one scale per expert (the hole, the entry is needed); a method
    that shares one scale, as an upstream fix would, flips the finding."""
    import torch

    ct = mm_probe.compressed_tensors_nvfp4_class_name()
    assert mm_probe.compressed_tensors_dp_scale_shared(ct) is False
    cls = _get(_CT, ct)
    stock = cls.process_weights_after_loading

    def shared(self, layer):  # one scale for every expert, as ModelOpt's #26135 does
        gs = layer.w13_input_global_scale
        layer.w13_input_global_scale = torch.nn.Parameter(gs.min().expand_as(gs).clone(),
                                                          requires_grad=False)
        stock(self, layer)

    monkeypatch.setattr(cls, "process_weights_after_loading", shared)
    assert mm_probe.compressed_tensors_dp_scale_shared(ct) is True
