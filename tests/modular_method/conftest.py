# SPDX-License-Identifier: Apache-2.0
"""The focused suite for a vLLM release in the modular_method MoE design (0.11.1 to 0.13.0).

It runs only when asked: ``VLLM_FP4_MOE_EXPECT_DESIGN=modular_method`` (``scripts/test.sh`` sets
it for ``.venv-vllm-0.12.0``). The installed vLLM must then probe as that design, or the run
stops (pytest exit 4, the error naming both designs) instead of testing the wrong release.
Without the variable nothing here is collected, so the default suite (vLLM 0.11.0) neither runs
these files nor imports vLLM's MoE code early.
"""

from tests.design_gate import collect_ignore_for

collect_ignore_glob = collect_ignore_for("modular_method")
