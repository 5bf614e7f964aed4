# SPDX-License-Identifier: Apache-2.0
"""What vLLM's own tests/conftest.py gives the patches' tests, for running them in an installed
vLLM outside its repository (scripts/bootstrap-patched.sh copies this next to them)."""

import logging

import pytest


@pytest.fixture()
def caplog_vllm(caplog):
    """``caplog`` that sees vLLM's records (its "vllm" logger does not propagate)."""
    logger = logging.getLogger("vllm")
    logger.propagate = True
    try:
        yield caplog
    finally:
        logger.propagate = False


@pytest.fixture()
def dist_init():
    """A one-rank vLLM world on gloo (TP=PP=1), as vLLM's own fixture of that name gives."""
    import tempfile

    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        init_distributed_environment(
            world_size=1, rank=0, distributed_init_method=f"file://{tempfile.mkstemp()[1]}",
            local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        yield
    cleanup_dist_env_and_memory()
