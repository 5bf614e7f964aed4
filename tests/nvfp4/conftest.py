# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the NVFP4 math / emulator tests: the device they run on.

``VLLM_FP4_MOE_TEST_DEVICE`` picks it (default ``cpu``; ``cuda`` on a GPU box). Everything in
``fp4_moe_lab.nvfp4`` follows its inputs' device, so the same tests cover both.
"""

import os

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    name = os.environ.get("VLLM_FP4_MOE_TEST_DEVICE", "cpu")
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("VLLM_FP4_MOE_TEST_DEVICE=cuda but no CUDA device is available")
        if dev.index is None:  # tensors report cuda:N; compare like with like
            dev = torch.device("cuda", torch.cuda.current_device())
    return dev


@pytest.fixture(autouse=True, scope="module")
def _single_cpu_thread():
    """Run these small-tensor tests on one intra-op thread, restored afterwards.

    Why: the tensors are tiny, and on the 2-core CI box intra-op threads only help when the box
    is idle; with other processes running (the multi-process layout tests), OpenMP's spinning
    threads made this suite ~6x slower (44 s vs 8 s measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
