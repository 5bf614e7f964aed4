# SPDX-License-Identifier: Apache-2.0
"""Item 6: load-time cost for a DeepSeek-R1-sized model (58 MoE layers x 256 experts).

Measured per rank in real gloo DP+EP groups (2 ranks: the ``dp_ep_allgather`` layout; 4 ranks:
a DP=4+EP group), by ``benchmarks.jobs.load_time``:

* the DP scale agreement, ``scale_agreement.agree_min_scale`` once per layer (a MIN all-reduce
  of one float over the EP group's CPU group), against the same number of plain ``dist.barrier``
  round trips -- the least any cross-rank agreement can cost;
* the load-time check, ``consistency.run_check`` once per layer (E_local experts, DP path),
  against building the same layers' ``FusedMoEQuantConfig`` -- work vLLM itself does per layer
  at that point (``get_fused_moe_quant_config``).
Worst rank. Times are for 58 layers together.
"""

from __future__ import annotations

from benchmarks.rows import Row


def rows(layout_results: dict, ranks_list) -> list[Row]:
    out = []
    worst_agree = 0.0
    check = None
    for n in ranks_list:
        key = "dp_ep_allgather" if n == 2 else f"load{n}"
        if key not in layout_results:
            continue
        res = [r["load"] for r in layout_results[key]]
        agree = max(r["agree"] for r in res)
        barrier = max(r["barrier"] for r in res)
        worst_agree = max(worst_agree, agree)
        out.append(Row(6, f"DP scale agreement x58, {n} gloo ranks", "ms", 1e3 * agree,
                       1e3 * barrier, "58 x dist.barrier", "info", None,
                       {"e_local": res[0]["e_local"]}))
        c = max(r["check"] for r in res)
        cfg = max(r["config"] for r in res)
        all_ok = all(r["all_ok"] for r in res)
        out.append(Row(6, f"load-time check x58, {n} ranks (E_local={res[0]['e_local']})",
                       "ms", 1e3 * c, 1e3 * cfg, "58 x build quant config", "info", None,
                       {"all_layers_consistent": all_ok}))
        check = c if check is None else max(check, c)
    if check is not None:
        total = worst_agree + check
        out.append(Row(6, "load-time total (agreement + check), worst", "ms", 1e3 * total,
                       None, "-", "< 1000 ms", total < 1.0))
    return out
