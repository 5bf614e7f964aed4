"""``vllm-fp4-moe``: one console script, one subcommand per job.

Subcommands return data from their own modules; printing and ``--json`` live here at the edge.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Optional, Sequence


def _cmd_matrix(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.simulation.layouts import LAYOUT_NAMES, Scenario
    from vllm_fp4_moe_plugin.simulation.matrix import format_table, run_matrix

    layouts = args.layout or list(LAYOUT_NAMES)
    scenario = Scenario(seed=args.seed, input_scale_spread=args.spread, tokens=args.tokens)
    rows = run_matrix(layouts, scenario, formats=tuple(args.format or
                                                        ("modelopt", "compressed-tensors")))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=2)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        print("NVFP4 MoE consistency matrix: real vLLM 0.11.0 code on CPU, SM100 simulated, "
              "FlashInfer 0.3.1 emulated.")
        print(f"Fixture: E={scenario.num_experts} H={scenario.hidden} I={scenario.intermediate} "
              f"top-{scenario.top_k}, {scenario.tokens} tokens/rank, per-expert input scales "
              f"spread {scenario.input_scale_spread:g}x, seed {scenario.seed}.")
        print("Errors are ||out - ref|| / ||ref|| against the ideal NVFP4 reference of the "
              "layout; 'noise floor' is that reference against fp32.\n")
        print(format_table(rows))
    return 0 if all(r.ok for r in rows) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-fp4-moe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("matrix", help="stock vs plugin in every layout, on real vLLM code (CPU)")
    m.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    m.add_argument("--save-json", metavar="PATH", help="also write the rows as JSON to PATH")
    m.add_argument("--layout", action="append", help="only this layout (repeatable)")
    m.add_argument("--format", action="append", choices=("modelopt", "compressed-tensors"))
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--spread", type=float, default=4.0,
                   help="max/min of the per-expert input scales (default 4)")
    m.add_argument("--tokens", type=int, default=32, help="tokens per rank")
    m.set_defaults(func=_cmd_matrix)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
