# SPDX-License-Identifier: Apache-2.0
"""The audit of real NVFP4 MoE checkpoints (the ``audit`` and ``doctor`` commands).

:mod:`.audit` (``audit_checkpoint``) judges what :mod:`.detect`, :mod:`.config_lint` and
:mod:`.scale_values` read; :mod:`.render` tabulates it; :mod:`.tensor_index` maps tensor names to
shards. Writing test checkpoints, or loading one through vLLM's model class, is not serving work
and lives outside this package.
"""
