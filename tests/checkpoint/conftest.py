# SPDX-License-Identifier: Apache-2.0
"""Checkpoints written once per session: every (arch, fmt) at the default spread."""

import pytest

ARCHS = ("deepseek_v3", "qwen3_moe")
FORMATS = ("modelopt", "compressed-tensors")


@pytest.fixture(scope="session")
def written(tmp_path_factory) -> dict:
    """``{(arch, fmt): manifest}`` of checkpoints written with the default arguments."""
    from fp4_moe_lab.checkpoint.writer import write_checkpoint  # torch: not unit tier

    root = tmp_path_factory.mktemp("written")
    return {(arch, fmt): write_checkpoint(root / f"{arch}-{fmt}", fmt=fmt, arch=arch)
            for arch in ARCHS for fmt in FORMATS}
