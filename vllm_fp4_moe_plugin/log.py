"""The plugin's logger.

vLLM configures a handler on the ``vllm`` logger and turns propagation off, so a logger outside
that tree prints nothing by default. Living under ``vllm.`` gives our lines vLLM's format and
honours ``VLLM_CONFIGURE_LOGGING`` / ``VLLM_LOGGING_LEVEL`` for free.
"""

import logging

LOGGER_NAME = "vllm.fp4_moe_plugin"


def get_logger(suffix: str = "") -> logging.Logger:
    return logging.getLogger(LOGGER_NAME + (f".{suffix}" if suffix else ""))
