# SPDX-License-Identifier: Apache-2.0
"""Item 2: host-side cost of one MoE ``apply()``, plugin vs stock, single-GPU layout.

Measured by ``benchmarks.jobs.apply_overhead`` in a spawned rank under the simulated SM100
path, with the seam's device work (quantizer, SF interleave, MoE kernel) replaced by no-ops
(``benchmarks.seam.host_only``): what is left is vLLM's and the plugin's Python/torch host
code (routing, modular-kernel setup, prepare/finalize, workspace allocation). On a GPU the
stock path also launches one quantize kernel that the plugin skips; that is not timed here.
"""

from __future__ import annotations

from benchmarks.rows import Row


def rows(layout_results: dict, calls: int) -> list[Row]:
    apply = layout_results["single"][0]["apply"]
    out = []
    for m, t in apply.items():
        us_p, us_s = 1e6 * t["plugin"], 1e6 * t["stock"]
        out.append(Row(2, f"apply() host time, tokens={m}", "us", us_p, us_s, "stock 0.11.0",
                       "ratio <= 1.00", us_p <= us_s,
                       {"note": f"median of {calls} calls in interleaved blocks, no-op device work",
                        "aa_ratio_stock_vs_stock": t["stock#2"] / t["stock"],
                        "pre_kernel_passes": t["pre_kernel_passes"]}))
    return out
