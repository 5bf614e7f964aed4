"""The task-accuracy table (docs/ACCURACY.md) and the checkpoint edits its rows serve.

* :mod:`.table` -- runs lm-eval against the engine worlds' OpenAI servers, writes the table.
* :mod:`.experts_only` -- NVFP4 experts with bf16 attention (what the CPU engines can serve).
* :mod:`.skew`, :mod:`.dead_scale` -- labelled edits of a quantized checkpoint's expert scales.

Standard library only. The commands are ``accuracy/run_table.py``, ``skew.py``,
``dead_scale.py`` and ``experts_only.py`` (accuracy/README.md).
"""
