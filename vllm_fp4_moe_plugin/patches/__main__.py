"""``python -m vllm_fp4_moe_plugin.patches`` prints the ledger as Markdown (docs/PATCHES.md)."""

from vllm_fp4_moe_plugin.patches import render_ledger_markdown

print(render_ledger_markdown())
