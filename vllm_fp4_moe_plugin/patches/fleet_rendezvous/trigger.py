# SPDX-License-Identifier: Apache-2.0
"""The fleet check's trigger: vLLM's ``init_world_group``, with this rank's state written before
the rendezvous and the fleet's verdict read after it (fleet.py)."""

from __future__ import annotations

import functools

from vllm_fp4_moe_plugin import fleet


def build(original):
    @functools.wraps(original)
    def init_world_group(*args, **kwargs):
        fleet.before_rendezvous()
        group = original(*args, **kwargs)
        fleet.after_rendezvous()
        return group
    return init_world_group
