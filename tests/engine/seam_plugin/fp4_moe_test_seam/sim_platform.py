# SPDX-License-Identifier: Apache-2.0
"""vLLM's CPU platform, reporting a non-x86 CPU (pure-torch unquantized MoE, no IPEX)."""

from vllm.platforms.cpu import CpuPlatform
from vllm.platforms.interface import CpuArchEnum


class SimCpuPlatform(CpuPlatform):
    @classmethod
    def get_cpu_architecture(cls) -> CpuArchEnum:
        return CpuArchEnum.ARM
