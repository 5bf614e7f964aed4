# SPDX-License-Identifier: Apache-2.0
"""Patching is all or nothing: a failure in any ledger patch leaves every vLLM
symbol the probe asked for at its original, and the process refuses to serve with one error
naming the target."""

import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest


def _design_targets():
    from vllm_fp4_moe_plugin.patches import ledger

    result = ledger.plan()
    return result.design, list(result.patches)


DESIGN, TARGETS = _design_targets()


def _resolve(target):
    """What ``target`` names now: the longest importable prefix, then attributes (a class's
    method too: ``...modular_kernel.FusedMoEModularKernel.forward``)."""
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise LookupError(target)


def _inject_failure(monkeypatch, target):
    """Make the build of ``target``'s replacement raise, after the entries before it applied."""
    from vllm_fp4_moe_plugin.patches import patching

    real = patching.ModulePatch.apply

    def apply(self):
        if self.target == target:
            raise RuntimeError("injected failure")
        return real(self)

    monkeypatch.setattr(patching.ModulePatch, "apply", apply)


@pytest.mark.skipif(not TARGETS, reason="the installed vLLM needs no patch")
@pytest.mark.parametrize("target", TARGETS)
def test_failure_in_any_patch_leaves_vllm_unpatched(fresh_plugin, monkeypatch, target):
    from vllm_fp4_moe_plugin.patches import ledger

    for trigger in fresh_plugin.vm.TRIGGER_MODULES:  # imported: the install runs in register()
        try:
            importlib.import_module(trigger)
        except ModuleNotFoundError:  # a trigger of another release's design
            pass
    before = {t: _resolve(t) for t in TARGETS}
    _inject_failure(monkeypatch, target)
    monkeypatch.setenv("VLLM_FP4_MOE_PLUGIN", "1")
    with pytest.raises(ledger.PatchInstallError, match=rf"could not patch {target} .*injected"):
        fresh_plugin.register()
    assert {t: _resolve(t) for t in TARGETS} == before, "a replacement is still installed"
    assert all(_resolve(t).__module__.startswith("vllm.") for t in TARGETS)
    assert ledger.applied_targets() == []
    state, reason = fresh_plugin.state()
    assert state == "failed" and target in reason


@pytest.mark.skipif(not TARGETS, reason="the installed vLLM needs no patch")
def test_apply_targets_reverts_patches_applied_by_an_earlier_call(fresh_plugin, monkeypatch):
    from vllm_fp4_moe_plugin.patches import ledger

    first, last = TARGETS[0], TARGETS[-1]
    original = _resolve(first)
    ledger.apply_targets(DESIGN, [first])
    assert _resolve(first) is not original
    _inject_failure(monkeypatch, last)
    with pytest.raises(ledger.PatchInstallError, match=last):
        ledger.apply_targets(DESIGN, TARGETS)
    assert _resolve(first) is original and ledger.applied_targets() == []


def test_unknown_target_is_refused_before_anything_is_applied(fresh_plugin):
    from vllm_fp4_moe_plugin.patches import ledger

    with pytest.raises(ledger.PatchInstallError, match="vllm.nowhere.Thing"):
        ledger.apply_targets(DESIGN or "init_prepare_finalize", [*TARGETS, "vllm.nowhere.Thing"])
    assert ledger.applied_targets() == []


@pytest.mark.skipif(not TARGETS, reason="the installed vLLM needs no patch")
def test_failed_install_inside_vllms_import_refuses_to_serve():
    """The real path: the install runs inside vLLM's own import of its quant module."""
    probe = Path(__file__).resolve().parents[1] / "probes" / "install_fails.py"
    proc = subprocess.run([sys.executable, str(probe), TARGETS[-1], *TARGETS[:-1]],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "VLLM_FP4_MOE_PLUGIN": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "REFUSED 1" in proc.stdout and "REFUSED 2" in proc.stdout, proc.stdout
    assert "SERVED UNPATCHED" not in proc.stdout
