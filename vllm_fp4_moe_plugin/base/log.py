# SPDX-License-Identifier: Apache-2.0
"""The plugin's logger.

vLLM configures a handler on the ``vllm`` logger and turns propagation off, so a logger outside
that tree prints nothing by default. Living under ``vllm.`` gives our lines vLLM's format and
honours ``VLLM_CONFIGURE_LOGGING`` / ``VLLM_LOGGING_LEVEL`` for free.
"""

import logging

LOGGER_NAME = "vllm.fp4_moe_plugin"


def get_logger(suffix: str = "") -> logging.Logger:
    return logging.getLogger(LOGGER_NAME + (f".{suffix}" if suffix else ""))


def layer_label(layer) -> str:
    """How messages name an MoE layer: vLLM's prefix (``model.layers.3.mlp.experts``) if set."""
    return getattr(layer, "layer_name", "") or type(layer).__name__


def local_experts_note(layer) -> str:
    """How messages qualify an expert index of a layer that holds only its EP rank's experts
    (vLLM 0.11.x ``FusedMoE.ep_rank`` / ``ep_size``); empty without EP."""
    ep_size = getattr(layer, "ep_size", 1)
    return f" (local to EP rank {layer.ep_rank} of {ep_size})" if ep_size > 1 else ""
