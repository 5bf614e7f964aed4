# SPDX-License-Identifier: Apache-2.0
"""Item 3: activation quantization passes, and their bytes, before the MoE kernel.

Counted at the seam (``benchmarks.seam.counting``): every ``fp4_quantize`` vLLM's prepare
calls through ``fused_moe.utils`` before the first kernel call of one forward, per rank, and
the activation bytes those passes read (bf16) and write (packed FP4 codes + block scales,
padded as FlashInfer pads them). The quantization the kernel does itself is not a pass here.
"""

from __future__ import annotations

from benchmarks.rows import Row
from fp4_moe_lab.simulation.layouts import LAYOUTS


def _worst(ranks, key: str, field: str) -> int:
    return max(r["schemes"]["counts"][key][field] for r in ranks)


def rows(layout_results: dict, spread: float) -> list[Row]:
    out = []
    for name, layout in LAYOUTS.items():
        if name not in layout_results:
            continue
        ranks = layout_results[name]
        p, s = f"{spread}/1.0/plugin", f"{spread}/1.0/stock"
        kernel_in = ranks[0]["schemes"]["counts"][p]["kernel_input"]
        extra = {"plugin_kernel_input": kernel_in,
                 "stock_kernel_input": ranks[0]["schemes"]["counts"][s]["kernel_input"]}
        pp, sp = _worst(ranks, p, "passes"), _worst(ranks, s, "passes")
        pb, sb = _worst(ranks, p, "pre_kernel_bytes"), _worst(ranks, s, "pre_kernel_bytes")
        if layout.dispatches_quantized:  # DP: one pass on the sender is unavoidable
            t1, ok1 = "= stock (1)", pp == sp == 1
            t2, ok2 = "= stock", pb == sb
        else:
            t1, ok1 = "plugin 0, stock 1", pp == 0 and sp == 1
            t2, ok2 = "plugin 0", pb == 0 and sb > 0
        out.append(Row(3, f"pre-kernel quant passes, {name}", "passes/fwd/rank", pp, sp,
                       "stock 0.11.0", t1, ok1, extra))
        out.append(Row(3, f"pre-kernel activation bytes, {name}", "B/fwd/rank", pb, sb,
                       "stock 0.11.0", t2, ok2))
    return out
