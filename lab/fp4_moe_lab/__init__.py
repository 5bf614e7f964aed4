# SPDX-License-Identifier: Apache-2.0
"""fp4_moe_lab: the development half of vllm-fp4-moe-plugin, never published (lab/pyproject.toml).

* :mod:`.nvfp4` -- NVFP4 math, FlashInfer/TRT-LLM kernel emulators and fp32 oracles (pure torch).
* :mod:`.simulation` -- the CPU simulation of Blackwell that runs real vLLM MoE layers.
* :mod:`.checkpoint` -- tiny deterministic NVFP4 MoE checkpoints.
* :mod:`.cli`, :mod:`.commands`, :mod:`.demo` -- the ``vllm-fp4-moe-lab`` console script:
  ``demo | matrix | make-checkpoint``.

It imports the serving package; the serving package never imports it.
"""
