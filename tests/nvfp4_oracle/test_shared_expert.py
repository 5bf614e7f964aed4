# SPDX-License-Identifier: Apache-2.0
"""A shared expert beside the routed ones (DeepSeek's, GLM's, Qwen3-Next's MoE: vLLM's MoE
runner calls it and adds its output) on the NVFP4-oracle release at DP=2+EP, on FlashInfer
CUTLASS and TRT-LLM: compressed-tensors' scale hole is there on both, shared expert or not;
the ModelOpt rows are stock's, bit for bit (tests/shared_expert_checks.py)."""

import pytest

from tests.shared_expert_checks import check_shared_expert_rows

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_a_shared_expert_beside_the_routed_ones_dp_ep():
    holes = {("compressed-tensors", "dp_ep_allgather", "flashinfer_cutlass"),
             ("compressed-tensors", "dp_ep_allgather", "flashinfer_trtllm")}
    rows = check_shared_expert_rows(["dp_ep_allgather"], holes,
                                    backends=["flashinfer_cutlass", "flashinfer_trtllm"])
    assert len(rows) == 4
