"""Tiny NVFP4 MoE checkpoints (both formats) and an audit of real ones.

* :mod:`.expert_tensors` -- one layer's experts as checkpoint tensor names, either format.
* :mod:`.configs` -- config.json / hf_quant_config.json for tiny DeepseekV3 and Qwen3-MoE.
* :mod:`.writer` -- ``write_checkpoint``: deterministic files vLLM 0.11.0 loads unchanged.
* :mod:`.audit` -- ``audit_checkpoint`` / ``format_audit``: is a checkpoint hit by the bug?
* :mod:`.tensor_index` -- tensor name -> shard file, from the index or the headers only.

Loading a checkpoint through vLLM's real model class is test-only and lives in
``tests/checkpoint/vllm_load.py`` (not in the wheel).

No imports here on purpose: ``simulation.moe_layer`` imports ``.expert_tensors`` and
``.configs`` imports ``simulation.moe_layer``.
"""
