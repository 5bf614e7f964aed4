# SPDX-License-Identifier: Apache-2.0
"""Layer 0: what every other layer reads, vLLM-free and torch-free at import: the switch and its
variables (envs), where in vLLM the plugin looks and the hook that waits for it (vllm_modules),
the model of where stock is wrong (support), logging, the parameter watch."""
