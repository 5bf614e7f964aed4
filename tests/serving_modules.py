# SPDX-License-Identifier: Apache-2.0
"""What the wheel users install may hold: the serving code and the operator commands (audit,
doctor), nothing of the development package (lab/fp4_moe_lab). One allow-list, read by
tests/test_wheel.py (the built wheel's files) and tests/plugin/test_serving_imports.py (what a
vLLM process with the plugin on imports). A new serving module is added here on purpose."""

from __future__ import annotations

PACKAGE = "vllm_fp4_moe_plugin"
LAB_PACKAGE = "fp4_moe_lab"

SERVING_MODULES = frozenset({
    "vllm_fp4_moe_plugin",
    "vllm_fp4_moe_plugin.checkpoint",
    "vllm_fp4_moe_plugin.checkpoint.audit",
    "vllm_fp4_moe_plugin.checkpoint.config_lint",
    "vllm_fp4_moe_plugin.checkpoint.detect",
    "vllm_fp4_moe_plugin.checkpoint.render",
    "vllm_fp4_moe_plugin.checkpoint.scale_values",
    "vllm_fp4_moe_plugin.checkpoint.tensor_index",
    "vllm_fp4_moe_plugin.cli",
    "vllm_fp4_moe_plugin.compat",
    "vllm_fp4_moe_plugin.consistency",
    "vllm_fp4_moe_plugin.doctor",
    "vllm_fp4_moe_plugin.envs",
    "vllm_fp4_moe_plugin.gate_up",
    "vllm_fp4_moe_plugin.fleet",
    "vllm_fp4_moe_plugin.import_hook",
    "vllm_fp4_moe_plugin.layer_scales",
    "vllm_fp4_moe_plugin.log",
    "vllm_fp4_moe_plugin.nvfp4_constants",
    "vllm_fp4_moe_plugin.off_warning",
    "vllm_fp4_moe_plugin.param_watch",
    "vllm_fp4_moe_plugin.patches",
    "vllm_fp4_moe_plugin.patches.bf16_passthrough",
    "vllm_fp4_moe_plugin.patches.fleet_rendezvous",
    "vllm_fp4_moe_plugin.patches.fleet_rendezvous.trigger",
    "vllm_fp4_moe_plugin.patches.init_prepare_finalize",
    "vllm_fp4_moe_plugin.patches.init_prepare_finalize.flashinfer_cutlass",
    "vllm_fp4_moe_plugin.patches.init_prepare_finalize.methods",
    "vllm_fp4_moe_plugin.patches.init_prepare_finalize.probe",
    "vllm_fp4_moe_plugin.patches.modular_method",
    "vllm_fp4_moe_plugin.patches.modular_method.all2allv_passthrough",
    "vllm_fp4_moe_plugin.patches.modular_method.compressed_tensors_dp",
    "vllm_fp4_moe_plugin.patches.modular_method.modelopt_uncalibrated",
    "vllm_fp4_moe_plugin.patches.modular_method.probe",
    "vllm_fp4_moe_plugin.patches.nvfp4_oracle",
    "vllm_fp4_moe_plugin.patches.nvfp4_oracle.ep_agreed_gemm1_scale",
    "vllm_fp4_moe_plugin.patches.nvfp4_oracle.non_local_routes",
    "vllm_fp4_moe_plugin.patches.nvfp4_oracle.router_weight_once",
    "vllm_fp4_moe_plugin.patches.nvfp4_oracle.probe",
    "vllm_fp4_moe_plugin.patches.nvfp4_oracle.weight_only_gate_up",
    "vllm_fp4_moe_plugin.patches.plugin_env",
    "vllm_fp4_moe_plugin.patches.registry",
    "vllm_fp4_moe_plugin.patching",
    "vllm_fp4_moe_plugin.probing",
    "vllm_fp4_moe_plugin.scale_agreement",
    "vllm_fp4_moe_plugin.scale_rule",
    "vllm_fp4_moe_plugin.support",
    "vllm_fp4_moe_plugin.unloaded",
    "vllm_fp4_moe_plugin.vllm_modules",
})

# The serving code stays small enough to review: physical lines of every Python file in the wheel
# (4,992 with the scale fixes; 5,187 with vLLM CUTLASS's route fix and its probe; 5,702 with the
# gate/up carry, the uncalibrated rule's window and EP view, and dummy weights; 5,761
# with Marlin's carry; 6,124 with the repair in front of upstream/0002's refusal and Llama-4's
# router weight counted once).
MAX_SERVING_LINES = 6300


def module_of(path: str) -> str:
    """``vllm_fp4_moe_plugin/patches/__init__.py`` -> ``vllm_fp4_moe_plugin.patches``."""
    parts = path[:-len(".py")].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

