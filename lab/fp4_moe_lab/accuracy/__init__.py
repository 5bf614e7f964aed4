# SPDX-License-Identifier: Apache-2.0
"""The task-accuracy table (docs/ACCURACY.md) and the checkpoint edits its rows serve.

* :mod:`.cells` -- what the table is made of (checkpoints, layouts, worlds, columns, cell keys).
* :mod:`.table` -- runs each cell: an engine world's OpenAI server, then lm-eval against it.
* :mod:`.report` -- docs/ACCURACY.md's table and the chart, from the table's JSON.
* :mod:`.experts_only` -- NVFP4 experts with bf16 attention (what the CPU engines can serve).
* :mod:`.skew`, :mod:`.dead_scale` -- labelled edits of a quantized checkpoint's expert scales.

Standard library only. The commands are ``accuracy/run_table.py``, ``skew.py``,
``dead_scale.py`` and ``experts_only.py`` (accuracy/README.md).
"""
