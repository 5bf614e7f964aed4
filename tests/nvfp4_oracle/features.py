# SPDX-License-Identifier: Apache-2.0
"""What the installed oracle-design vLLM has, asked by feature (never by version string), for the
tests that cannot apply where it lacks it: they skip by name, saying why."""

import pytest

ONE_SIDED = "dp_ep_one_sided"


def one_sided_reason() -> str:
    """Why the ``dp_ep_one_sided`` layout has no rows here: this vLLM's one-sided NVLink
    manager has no ``get_communication`` (the ``moe_ep`` contract the seam's gloo twin
    implements, v0.34.0 distributed/device_communicators/all2all.py:895); v0.20.0's drives
    FlashInfer's ``MoeAlltoAll`` payload lists instead (v0.20.0 distributed/device_communicators/
    all2all.py:556-670, prepare_finalize/flashinfer_nvlink_one_sided.py:111-116), a transport the
    simulation does not twin (blackwell_oracle.simulates_one_sided)."""
    return ("this vLLM's FlashInferNVLinkOneSidedManager has no get_communication: it lacks "
            "the moe_ep one-sided contract (its manager drives FlashInfer's MoeAlltoAll payload "
            "lists, as v0.20.0 distributed/device_communicators/all2all.py:556-670 does), "
            "which the seam does not twin, so the matrix has no dp_ep_one_sided rows")


def skip_unless_matrix_has(layout: str) -> None:
    """Skip a test of ``layout``'s matrix rows where the installed vLLM's matrix has none."""
    from fp4_moe_lab.simulation.layouts import default_layouts

    if layout not in default_layouts():
        assert layout == ONE_SIDED, layout  # the only layout a release may lack
        pytest.skip(one_sided_reason())
