# SPDX-License-Identifier: Apache-2.0
"""A shared expert beside the routed ones (DeepSeek's, GLM's, Qwen3-Next's MoE) on the
modular-method release at DP=2+EP: compressed-tensors' scale hole is there, shared expert or
not; the ModelOpt row is stock's, bit for bit (tests/shared_expert_checks.py)."""

import pytest

from tests.shared_expert_checks import check_shared_expert_rows

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_a_shared_expert_beside_the_routed_ones_dp_ep():
    rows = check_shared_expert_rows(
        ["dp_ep_allgather"], {("compressed-tensors", "dp_ep_allgather", "flashinfer_cutlass")})
    assert len(rows) == 2
