# SPDX-License-Identifier: Apache-2.0
"""register(): opt-in, idempotent, one INFO line when active; on a vLLM it cannot patch it is
inactive with one WARNING naming the reason, and strict mode refuses to start."""

import importlib
import logging

import pytest

from tests.conftest import plugin_records

MO = "vllm.model_executor.layers.quantization.modelopt"
CT = "vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe"
FX = "vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe"
SYMBOLS = [(MO, "ModelOptNvFp4FusedMoE"), (CT, "CompressedTensorsW4A4MoeMethod"),
           (FX, "flashinfer_cutlass_moe_fp4")]


def _current():
    return {f"{m}.{a}": getattr(importlib.import_module(m), a) for m, a in SYMBOLS}


@pytest.mark.parametrize("value", [None, "0"])
def test_unset_or_zero_leaves_vllm_untouched(fresh_plugin, monkeypatch, caplog_plugin, value):
    before = _current()
    if value is not None:
        monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", value)
    fresh_plugin.register()
    assert _current() == before
    assert fresh_plugin.state()[0] == "inert"
    assert plugin_records(caplog_plugin) == []


def test_bad_value_fails_clearly_and_patches_nothing(fresh_plugin, monkeypatch):
    before = _current()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "yes")
    with pytest.raises(ValueError, match="VLLM_FP4_MOE_PLUGIN='yes'"):
        fresh_plugin.register()
    assert _current() == before


def test_enabled_rebinds_same_names_and_logs_one_line(fresh_plugin, monkeypatch, caplog_plugin):
    before = _current()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    after = _current()
    assert fresh_plugin.state()[0] == "active"
    for target, original in before.items():
        assert after[target] is not original, target
    for name in ("ModelOptNvFp4FusedMoE", "CompressedTensorsW4A4MoeMethod"):
        new = next(v for k, v in after.items() if k.endswith(name))
        old = next(v for k, v in before.items() if k.endswith(name))
        assert new.__name__ == name and issubclass(new, old)
    lines = plugin_records(caplog_plugin)
    assert len(lines) == 1 and lines[0].levelno == logging.INFO
    for target in before:
        assert target in lines[0].getMessage()


@pytest.mark.parametrize("switch", ["1", "0", None])
def test_bad_check_mode_fails_at_register(fresh_plugin, monkeypatch, switch):
    """Validated whenever it is set, also while the plugin is off."""
    if switch is None:
        monkeypatch.delenv("VLLM_FP4_MOE_PLUGIN", raising=False)
    else:
        monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", switch)
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "bogus")
    with pytest.raises(ValueError, match="VLLM_FP4_MOE_PLUGIN_CHECK"):
        fresh_plugin.register()


def test_register_twice_is_a_no_op(fresh_plugin, monkeypatch, caplog_plugin):
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    first = _current()
    fresh_plugin.register()
    assert _current() == first
    assert len(plugin_records(caplog_plugin)) == 1


def test_other_moe_design_stays_inactive(fresh_plugin, monkeypatch, caplog_plugin):
    """A mixed design (0.11.0's init_prepare_finalize *and* 0.11.1's maybe_init_modular_kernel)
    is neither design the plugin knows: it is left alone, with one line saying so."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    monkeypatch.setattr(FusedMoE, "maybe_init_modular_kernel", lambda self: None, raising=False)
    before = _current()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    assert _current() == before
    state, reason = fresh_plugin.state()
    assert state == "inactive" and "none of the designs this plugin knows" in reason
    lines = plugin_records(caplog_plugin)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    msg = lines[0].getMessage()
    assert "enabled (VLLM_FP4_MOE_PLUGIN=1) but inactive" in msg and reason in msg
    assert "vllm-fp4-moe doctor" in msg


def test_strict_check_refuses_to_start_where_the_plugin_is_inactive(fresh_plugin, monkeypatch,
                                                                    caplog_plugin):
    """VLLM_FP4_MOE_PLUGIN_CHECK=strict: asked for and not given is an error, and a retried
    import of vLLM's NVFP4 MoE modules raises it again (the process cannot serve stock)."""
    import sys

    from vllm.model_executor.layers.fused_moe.layer import FusedMoE

    monkeypatch.setattr(FusedMoE, "maybe_init_modular_kernel", lambda self: None, raising=False)
    before = _current()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN_CHECK", "strict")
    with pytest.raises(fresh_plugin.PluginInactiveError, match="strict refuses to start"):
        fresh_plugin.register()
    assert _current() == before
    assert fresh_plugin.state()[0] == "failed"
    lines = plugin_records(caplog_plugin)
    assert len(lines) == 1 and lines[0].levelno == logging.ERROR
    monkeypatch.delitem(sys.modules, MO)
    with pytest.raises(fresh_plugin.PluginInactiveError):
        importlib.import_module(MO)


def test_upstream_tp_fix_present_stays_inactive(fresh_plugin, monkeypatch, caplog_plugin):
    """FlashInferExperts(use_dp=...) means #27223 landed: the 0.11.0 patches would fight it."""
    from vllm.model_executor.layers.fused_moe.flashinfer_cutlass_moe import FlashInferExperts

    def init(self, out_dtype, quant_config, ep_rank=0, ep_size=1, tp_rank=0, tp_size=1,
             use_dp=False):
        raise AssertionError("not called")

    monkeypatch.setattr(FlashInferExperts, "__init__", init)
    before = _current()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    assert _current() == before
    assert fresh_plugin.state()[0] == "inactive"
    # a partial backport is not a fix: stock may still be wrong, so it is a WARNING
    lines = plugin_records(caplog_plugin)
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "part of the upstream fix" in lines[0].getMessage()


def test_probe_never_raises(monkeypatch):
    from vllm_fp4_moe_plugin.patches import compat

    def boom():
        raise RuntimeError("surprise")

    monkeypatch.setattr(compat, "_probe", boom)
    result = compat.probe()
    assert not result.patchable and "surprise" in result.reason


def test_entry_point_is_discovered_by_vllm(fresh_plugin, monkeypatch):
    """vLLM's own loader finds `fp4_moe` (installed package metadata) and calls register()."""
    import vllm.plugins as vllm_plugins

    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "fp4_moe")
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    vllm_plugins.load_general_plugins()
    assert fresh_plugin.state()[0] == "active"


def test_restrictive_vllm_plugins_list_skips_us(fresh_plugin, monkeypatch):
    import vllm.plugins as vllm_plugins

    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    monkeypatch.setattr(vllm_plugins, "plugins_loaded", False)
    vllm_plugins.load_general_plugins()
    assert fresh_plugin.state()[0] is None


def test_register_is_cheap_and_patches_when_vllm_imports_moe_code():
    """In a fresh process: register() imports no MoE code, and the patch lands on first use."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    probe = Path(__file__).resolve().parents[1] / "probes" / "register_deferred.py"
    proc = subprocess.run([sys.executable, str(probe)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_FP4_MOE_PLUGIN": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    ms = float(proc.stdout.split("REGISTER_MS")[1].split()[0])
    assert ms < 50, ms
    assert (proc.stdout + proc.stderr).count("vllm-fp4-moe-plugin active") == 1


def test_unusable_oracle_design_stays_inactive_with_its_reason(fresh_plugin, monkeypatch,
                                                              caplog_plugin):
    """An NVFP4 backend oracle the plugin cannot use (here: present but not importable, as on
    this 0.11.0 world where it is faked) leaves vLLM alone: one line naming the oracle."""
    from vllm.model_executor.layers.fused_moe.layer import FusedMoE, FusedMoEMethodBase

    from vllm_fp4_moe_plugin.patches import compat

    monkeypatch.delattr(FusedMoEMethodBase, "init_prepare_finalize")
    monkeypatch.setattr(FusedMoE, "maybe_init_modular_kernel", lambda self: None, raising=False)
    monkeypatch.setattr(compat, "_nvfp4_oracle_present", lambda: True)
    before = _current()
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    fresh_plugin.register()
    assert _current() == before
    state, reason = fresh_plugin.state()
    assert state == "inactive" and "oracle" in reason and "docs/SUPPORT.md" in reason
    lines = plugin_records(caplog_plugin)
    assert len(lines) == 1 and "inactive" in lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING
