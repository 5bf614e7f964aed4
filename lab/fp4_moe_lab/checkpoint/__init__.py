# SPDX-License-Identifier: Apache-2.0
"""Tiny deterministic NVFP4 MoE checkpoints (both formats), for the tests and the demo.

* :mod:`.expert_tensors` -- one layer's experts as checkpoint tensor names, either format.
* :mod:`.configs` -- config.json / hf_quant_config.json for tiny DeepseekV3 and Qwen3-MoE.
* :mod:`.writer` -- ``write_checkpoint``: deterministic files vLLM 0.11.0 loads unchanged.
* :mod:`.writer_limits` -- what the writer accepts, torch-free.

The audit of real checkpoints is serving code: :mod:`vllm_fp4_moe_plugin.tools.checkpoint`.

No imports here on purpose: ``simulation.moe_layer`` imports ``.expert_tensors`` and
``.configs``.
"""
