# SPDX-License-Identifier: Apache-2.0
"""A shared expert beside the routed ones (DeepSeek-R1's MoE) on vLLM 0.11.0 at TP=2+EP: both
formats on FlashInfer CUTLASS and ModelOpt on TRT-LLM, whose monolithic path runs the shared
expert in the layer's own forward. 0.11.0's scale holes are in every row; the plugin computes
the layer, the shared expert included, as the reference does (tests/shared_expert_checks.py)."""

import pytest

from tests.shared_expert_checks import check_shared_expert_rows

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]


def test_a_shared_expert_beside_the_routed_ones_tp_ep():
    holes = {("modelopt", "tp_ep", "flashinfer_cutlass"),
             ("compressed-tensors", "tp_ep", "flashinfer_cutlass"),
             ("modelopt", "tp_ep", "flashinfer_trtllm")}
    rows = check_shared_expert_rows(["tp_ep"], holes)
    assert {(r.format, r.layout, r.backend) for r in rows} == holes
