# SPDX-License-Identifier: Apache-2.0
"""The CPU simulation of Blackwell (SM100) that the ``matrix`` and ``demo`` commands and the tests
run real vLLM layers in; never used by ``register()`` (docs/ARCHITECTURE.md).

A regular package, not a namespace one: setuptools' ``packages = find:`` skips directories
without ``__init__.py``, so without this file the wheel had no ``simulation/`` and an installed
``vllm-fp4-moe-lab matrix`` / ``demo`` could not import it. No imports here on purpose.
"""
