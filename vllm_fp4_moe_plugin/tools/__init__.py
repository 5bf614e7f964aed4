# SPDX-License-Identifier: Apache-2.0
"""Layer 4: the operator's commands (``vllm-fp4-moe audit|doctor``) and the checkpoint reader
they share. Nothing a serving process imports."""
