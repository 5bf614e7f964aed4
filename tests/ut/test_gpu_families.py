# SPDX-License-Identifier: Apache-2.0
"""Which NVFP4 MoE kernel each design runs on each Blackwell family (support.nvfp4_moe_kernel):
10.0 (B200/GB200), 10.3 (B300/GB300), 12.0 (RTX PRO 6000 / RTX 5090), 12.1 (DGX Spark GB10).
Expected values are read from the wheels (docs/SUPPORT.md, GPU families), not from the code."""

import pytest

from vllm_fp4_moe_plugin.base import support
from vllm_fp4_moe_plugin.base.support import Design

FAILS = support.FAILS_TO_START
INIT, MODULAR, ORACLE = Design.INIT_PREPARE_FINALIZE, Design.MODULAR_METHOD, Design.NVFP4_ORACLE
GPUS = ("10.0", "10.3", "12.0", "12.1")


@pytest.mark.parametrize("design,env,backend,moe_backend,kernels", [
    # 0.11.0: vLLM's own kernel by default, images for sm_100a only
    (INIT, False, None, None, ("vllm_cutlass", FAILS, FAILS, FAILS)),
    # ... and FlashInfer only on exactly 10.0 (throughput: CUTLASS)
    (INIT, True, None, None, ("flashinfer_cutlass", FAILS, FAILS, FAILS)),
    # 0.11.1-0.13.0 and 0.14.x: vLLM's own kernel, images for sm_100a and sm_120a
    (MODULAR, False, None, None, ("vllm_cutlass", FAILS, "vllm_cutlass", FAILS)),
    # 0.11.1-0.13.0 with FlashInfer: latency (TRT-LLM) not modelled; throughput is CUTLASS
    (MODULAR, True, None, None, (None, None, "flashinfer_cutlass", "flashinfer_cutlass")),
    (MODULAR, True, "throughput", None, ("flashinfer_cutlass",) * 4),
    (ORACLE, False, None, None, ("vllm_cutlass", FAILS, "vllm_cutlass", FAILS)),
    # FlashInfer asked for: latency (the default from 0.12.0) is TRT-LLM on the 10.x family
    (ORACLE, True, None, None, ("flashinfer_trtllm", "flashinfer_trtllm", "flashinfer_cutlass",
                                "flashinfer_cutlass")),
    (ORACLE, True, "throughput", None, ("flashinfer_cutlass",) * 4),
    # 0.20.0+: --moe-backend auto
    (ORACLE, False, None, "auto", ("flashinfer_trtllm", "flashinfer_trtllm", "flashinfer_cutlass",
                                   "flashinfer_cutlass")),
    (ORACLE, False, None, "cutlass", ("vllm_cutlass",) * 4),
])
def test_kernel_per_family(design, env, backend, moe_backend, kernels):
    got = tuple(support.nvfp4_moe_kernel(design, gpu, "compressed-tensors", flashinfer_env=env,
                                         flashinfer_backend=backend, moe_backend=moe_backend)[0]
                for gpu in GPUS)
    assert got == kernels


def test_the_reason_names_the_gpu_and_what_vllm_lacks():
    kernel, why = support.nvfp4_moe_kernel(INIT, "12.0", "modelopt")
    assert kernel == FAILS and "SM120" in why and "no image" in why and "10.0" in why


@pytest.mark.parametrize("gpu", GPUS)
def test_the_oracle_hole_on_every_family_where_flashinfer_runs(gpu):
    """compressed-tensors DP+EP with the default dispatch: a hole on every FlashInfer kernel the
    family runs (0.20.0+ auto), none on vLLM's own per-expert kernel."""
    kernel, _ = support.nvfp4_moe_kernel(ORACLE, gpu, "compressed-tensors", moe_backend="auto")
    assert support.stock_hole(ORACLE, "compressed-tensors", "dp_ep_allgather", kernel) == \
        support.WRONG
    assert support.stock_hole(ORACLE, "compressed-tensors", "dp_ep_allgather",
                              "vllm_cutlass") is None
