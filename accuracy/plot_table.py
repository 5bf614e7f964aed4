# SPDX-License-Identifier: Apache-2.0
"""Draw docs/accuracy.png from the accuracy table's rows (run by accuracy/run_table.py in a
Python that has matplotlib, which the engine worlds need not have).

Usage: python accuracy/plot_table.py ROWS_JSON PNG_OUT
"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

COLS = ["bf16", "ideal", "stock", "plugin"]
COLORS = {"bf16": "#888888", "ideal": "#2b8cbe", "stock": "#e34a33", "plugin": "#31a354"}


def main(rows_json: str, png_out: str) -> None:
    with open(rows_json) as f:
        rows = json.load(f)
    # one horizontal group of bars per row (rows top to bottom as in the table): readable at any
    # number of rows
    fig, ax = plt.subplots(figsize=(9, 1.6 + 0.42 * len(rows)))
    h = 0.2
    for j, c in enumerate(COLS):
        ys, xs, lo, hi = [], [], [], []
        for i, r in enumerate(rows):
            cell = r["cells"].get(c)
            if not cell:
                continue
            ys.append(i + (j - 1.5) * h)
            xs.append(cell["accuracy"])
            # max(0, ...): at 500/500 the float upper bound lands a hair below 1.0
            lo.append(max(0.0, cell["accuracy"] - cell["wilson95"][0]))
            hi.append(max(0.0, cell["wilson95"][1] - cell["accuracy"]))
        ax.barh(ys, xs, h, xerr=[lo, hi], capsize=1.5, label=c, color=COLORS[c])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['world']} {r['layout']}  {r['checkpoint']}"
                        f"{' (EDITED)' if r.get('edited') else ''}"
                        for r in rows], fontsize=7.5)
    ax.invert_yaxis()
    ax.set_xlim(0, 1.0)
    ax.set_xlabel("exact match (95 % Wilson)")
    ax.set_title("3-digit addition exact match through vLLM's OpenAI server + lm-eval\n"
                 "NVFP4 MoE: Qwen3-MoE 6.7M; dsv3 = DeepSeek-V3 8.8M", fontsize=9)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / len(rows) - 0.04), fontsize=8,
              ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(png_out, dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:3])
