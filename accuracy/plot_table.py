# SPDX-License-Identifier: Apache-2.0
"""Draw docs/data/accuracy.png from the accuracy table's rows (run by accuracy/run_table.py in a
Python that has matplotlib, which the engine worlds need not have).

Usage: python accuracy/plot_table.py ROWS_JSON PNG_OUT
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

COLORS = {"ideal": "#2b8cbe", "stock": "#e34a33", "plugin": "#31a354"}


def _acc(row: dict, col: str):
    cell = row["cells"].get(col)
    return None if not cell else cell


def main(rows_json: str, png_out: str) -> None:
    """Only the rows where stock and the plugin score differently, one line each from stock to
    the plugin (95 % Wilson intervals as whiskers, the ideal kernel as a tick): what the table
    shows in 50 rows, at a glance. The rows where they agree are counted in the title."""
    with open(rows_json) as f:
        rows = json.load(f)
    measured = [r for r in rows if _acc(r, "stock") and _acc(r, "plugin")]
    differ = [r for r in measured
              if _acc(r, "stock")["accuracy"] != _acc(r, "plugin")["accuracy"]]
    fig, ax = plt.subplots(figsize=(8.5, 1.9 + 0.42 * len(differ)))
    for i, r in enumerate(differ):
        s, p = _acc(r, "stock"), _acc(r, "plugin")
        ax.plot([s["accuracy"], p["accuracy"]], [i, i], color="#cccccc", lw=3, zorder=1)
        for col, cell in (("stock", s), ("plugin", p), ("ideal", _acc(r, "ideal"))):
            if not cell:
                continue
            lo = max(0.0, cell["accuracy"] - cell["wilson95"][0])
            hi = max(0.0, cell["wilson95"][1] - cell["accuracy"])
            ax.errorbar(cell["accuracy"], i, xerr=[[lo], [hi]], fmt="|" if col == "ideal"
                        else "o", color=COLORS[col], ms=12 if col == "ideal" else 7, capsize=2,
                        zorder=2 if col == "ideal" else 3, label=col if i == 0 else None)
    ax.set_yticks(range(len(differ)))
    ax.set_yticklabels([f"{r['world']} {r['layout']}  {r['checkpoint']}"
                        f"{' (EDITED)' if r.get('edited') else ''}" for r in differ], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(-0.02, 1.02)
    ax.set_xlabel("exact match on 3-digit addition, 95 % Wilson (vLLM OpenAI server + lm-eval)",
                  fontsize=9)
    ax.set_title(f"Stock vs the plugin where they differ: {len(differ)} of {len(measured)} rows\n"
                 f"(the other {len(measured) - len(differ)}: stock = plugin; docs/ACCURACY.md "
                 "has every row)", fontsize=9)
    ax.grid(axis="x", color="#eeeeee")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.9 / (1.9 + 0.42 * len(differ))),
              fontsize=8, ncol=3, frameon=False)
    fig.tight_layout()
    fig.savefig(png_out, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:3])
