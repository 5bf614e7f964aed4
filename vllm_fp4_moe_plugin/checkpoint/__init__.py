"""The audit of real NVFP4 MoE checkpoints (the ``audit`` and ``doctor`` commands).

* :mod:`.audit` -- ``audit_checkpoint``: is a checkpoint hit by the bug? From :mod:`.detect`
  (which format), :mod:`.config_lint` (misread config keys) and :mod:`.scalars` (the scales read);
  :mod:`.render` -- ``format_audit``, its table.
* :mod:`.tensor_index` -- tensor name -> shard file, from the index or the headers only.

Writing tiny test checkpoints is development code: ``fp4_moe_lab.checkpoint`` (lab/, not in the
wheel). Loading a checkpoint through vLLM's real model class is test-only and lives in
``tests/checkpoint/vllm_load.py``.
"""
