# SPDX-License-Identifier: Apache-2.0
"""The development commands of ``vllm-fp4-moe-lab`` (:mod:`fp4_moe_lab.cli` parses them):
matrix, make-checkpoint, demo. Errors are the serving CLI's ``UsageError`` (exit 2, one line),
findings return ``EXIT_FINDING``, as in the operator's commands.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional, Sequence

from fp4_moe_lab.simulation.gpus import DEFAULT_CAPABILITY, GPUS
from vllm_fp4_moe_plugin.tools.cli import EXIT_FINDING, EXIT_OK, FORMATS, UsageError, progress

# where --gate-up-split rows run unless --layout names others: one rank, and every rank's
# experts their own (the plugin's carry then rides each rank's GEMM2 scales)
GATE_UP_SPLIT_LAYOUTS = ("single", "dp_ep_allgather")


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``vllm-fp4-moe-lab`` subcommand ``args.command``."""
    return COMMANDS[args.command](args)


def _check_output_file(path: Optional[str], flag: str) -> None:
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{flag} {path}: is a directory; give a file path")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise UsageError(f"{flag} {path}: not writable; choose a writable path")


def _check_capability(capability: str) -> None:
    """A GPU other than 10.0 needs a vLLM whose probes the seam models per family."""
    from fp4_moe_lab.simulation import blackwell_oracle

    if not blackwell_oracle.simulates_capability(capability):
        raise UsageError(f"--capability {capability}: not simulated on this vLLM (GPUs other "
                         "than 10.0 need FlashInferExperts' own device probe, as in vLLM "
                         "0.34.0); drop --capability")


def _emulated(backends) -> str:
    """What stands in for the GPU kernels of the rows asked for (--backend)."""
    own = "vLLM's own CUTLASS NVFP4 MoE ops"
    if backends and set(backends) == {"vllm_cutlass"}:
        return own
    fi = "FlashInfer's NVFP4 MoE contract"
    return f"{fi} and {own}" if backends and "vllm_cutlass" in backends else fi


def _gpus_line(capabilities: Sequence[str]) -> str:
    """``SM120 (RTX PRO 6000/RTX 5090)``, joined with ``and`` for several."""
    return " and ".join(f"SM{c.replace('.', '')} ({GPUS[c]})" for c in capabilities)


# The one kernel whose non-gated (relu2) contract is emulated (nvfp4/fused_moe_emulator.py).
NON_GATED_BACKEND = "flashinfer_cutlass"
# The kernels whose rows take a router weight on the input (vLLM's prepare scales the input);
# TRT-LLM only where vLLM runs its modular experts (DP+EP, the NVFP4-oracle design): elsewhere
# its self-routing kernel takes the flag itself, and its Llama-4 routing is not emulated.
ROUTER_ON_INPUT_BACKENDS = ("flashinfer_cutlass", "vllm_cutlass", "flashinfer_trtllm")


def _check_trtllm_router_on_input(layouts) -> None:
    """TRT-LLM rows of Llama-4's MoE: its modular experts only (DP+EP on the NVFP4-oracle
    design, ``trtllm_fp4_block_scale_routed_moe`` emulated)."""
    from fp4_moe_lab.simulation.layouts import LAYOUTS
    from fp4_moe_lab.simulation.matrix import installed_release, trtllm_routes_itself
    from vllm_fp4_moe_plugin.base.support import Design

    if installed_release()[1] is not Design.NVFP4_ORACLE:
        raise UsageError("--router-weight-on-input --backend flashinfer_trtllm: the NVFP4-oracle "
                         "design's modular TRT-LLM experts only (vLLM 0.14.0+); not this vLLM")
    own = [name for name in layouts if trtllm_routes_itself("flashinfer_trtllm", LAYOUTS[name])]
    if own:
        raise UsageError(f"--router-weight-on-input --backend flashinfer_trtllm --layout "
                         f"{own[0]}: vLLM runs TRT-LLM's self-routing kernel there, which takes "
                         "Llama-4's weight itself (its Llama-4 routing is not emulated); ask "
                         "for DP+EP layouts (the modular experts)")


def _cmd_matrix(args: argparse.Namespace) -> int:
    from fp4_moe_lab.simulation.layouts import Scenario, default_layouts

    known = default_layouts()  # + dp_ep_one_sided where the installed vLLM has it (0.34.0)
    layouts = args.layout or list(known)
    unknown = [name for name in layouts if name not in known]
    if unknown:
        raise UsageError(f"--layout {unknown[0]}: unknown layout; choose from "
                         f"{', '.join(known)}")
    _check_output_file(args.save_json, "--save-json")
    formats = tuple(dict.fromkeys(args.format or FORMATS))
    capabilities = list(dict.fromkeys(args.capability or [DEFAULT_CAPABILITY]))
    if args.uncalibrated and args.gate_up_split:
        raise UsageError("--uncalibrated and --gate-up-split are two tables; ask for one")
    if args.non_gated and (args.uncalibrated or args.gate_up_split):
        raise UsageError("--non-gated: non-gated experts have no gate/up pair, and their "
                         "uncalibrated rows are not a table yet; drop one of the two")
    if args.uncalibrated:
        if args.shared_expert:
            raise UsageError("--shared-expert: the --uncalibrated table has no shared-expert "
                             "rows; drop one of the two")
        if capabilities != [DEFAULT_CAPABILITY]:
            raise UsageError(f"--capability {capabilities[-1]}: the --uncalibrated table is "
                             f"simulated on {DEFAULT_CAPABILITY} only; drop one of the two")
        return _uncalibrated_table(args, args.layout, formats)
    if args.router_weight_on_input:
        if args.uncalibrated or args.gate_up_split or args.non_gated:
            raise UsageError("--router-weight-on-input is a table of its own; drop the other "
                             "table option")
        if set(args.backend or ()) - set(ROUTER_ON_INPUT_BACKENDS):
            raise UsageError("--router-weight-on-input: --backend "
                             f"{' or '.join(ROUTER_ON_INPUT_BACKENDS)}")
        args.backend = list(args.backend or ROUTER_ON_INPUT_BACKENDS[:1])
        if "flashinfer_trtllm" in args.backend:
            _check_trtllm_router_on_input(layouts)
    if args.non_gated:
        if set(args.backend or ()) - {NON_GATED_BACKEND}:
            raise UsageError(f"--non-gated: only --backend {NON_GATED_BACKEND} is emulated for "
                             "non-gated experts (FlashInfer 0.7.4's Relu2 path, read)")
        args.backend = [NON_GATED_BACKEND]
    scenario = Scenario(seed=args.seed, input_scale_spread=args.spread or 4.0,
                        tokens=args.tokens, gated=not args.non_gated,
                        router_weight_on_input=args.router_weight_on_input,
                        # Llama-4's MoE has one
                        shared_expert=args.shared_expert or args.router_weight_on_input,
                        top_k=1 if args.router_weight_on_input else Scenario.top_k)
    # (label, fixture) per table: the default layer, or one per --gate-up-split ratio
    cases = [(None, scenario)]
    if args.gate_up_split:
        # input scales shared (unless --spread): what stock gets wrong is the split's doing
        split_base = replace(scenario, input_scale_spread=args.spread or 1.0)
        cases = [(f"gate/up split {r:g}x", replace(split_base, gate_up_split=r))
                 for r in dict.fromkeys(args.gate_up_split)]
        # the label names the scales' worst ratio as quantized (the masters' amaxes add to it)
        cases = [(f"{label} (worst {fixture.gate_up_worst_ratio():.3g})", fixture)
                 for label, fixture in cases]
        layouts = args.layout or list(GATE_UP_SPLIT_LAYOUTS)
    for capability in capabilities:
        _check_capability(capability)
    if {"auto", "vllm_cutlass"} & set(args.backend or ()):
        from fp4_moe_lab.simulation import blackwell_oracle

        takes = blackwell_oracle.applies() and blackwell_oracle.takes_moe_backend()
        if "auto" in args.backend and not takes:
            raise UsageError("--backend auto: vLLM's --moe-backend auto, which this vLLM does "
                             "not have (KernelConfig.moe_backend, 0.20.0+); name the backend")
        if "vllm_cutlass" in args.backend and not (
                takes and blackwell_oracle.simulates_vllm_cutlass()):
            raise UsageError("--backend vllm_cutlass: vLLM's --moe-backend cutlass, simulated "
                             "on vLLMs whose CutlassExpertsFp4 has its own device probe and "
                             "the NVFP4 experts ops (read on 0.34.0); not this one")

    from fp4_moe_lab.simulation.matrix import format_table, run_matrix

    rows = []
    start = time.monotonic()
    jobs = [(c, case, name) for c in capabilities for case in cases for name in layouts]
    for i, (capability, (label, fixture), name) in enumerate(jobs, 1):
        at = f"{name} at {capability}" if len(capabilities) > 1 else name
        at = f"{at}, {label}" if label else at
        progress(f"matrix: [{i}/{len(jobs)}] {at} ...")
        t = time.monotonic()
        # every backend of that layout (or those asked for with --backend)
        layout_rows = [replace(r, case=label) for r in run_matrix(
            [name], fixture, formats, backends=args.backend, capability=capability)]
        rows.extend(layout_rows)
        oks = ", ".join(f"{r.format}/{r.backend} {'ok' if r.ok else 'NOT ok'}"
                        for r in layout_rows)
        progress(f"matrix: [{i}/{len(jobs)}] {at} done in {time.monotonic() - t:.0f} s "
                  f"({oks})")
    progress(f"matrix: {len(rows)} rows in {time.monotonic() - start:.0f} s")
    if args.save_json:
        try:
            with open(args.save_json, "w") as f:
                json.dump([r.as_dict() for r in rows], f, indent=2)
        except OSError as exc:
            raise UsageError(f"--save-json {args.save_json}: cannot write "
                             f"({exc.strerror or exc}); choose another path") from None
    if args.json:
        print(json.dumps([r.as_dict() for r in rows], indent=2))
    else:
        from fp4_moe_lab.simulation.matrix import installed_release

        version, design = installed_release()
        print(f"NVFP4 MoE consistency matrix: real vLLM {version} code on CPU ("
              f"{design.label if design else 'a design the plugin does not know: inactive'}), "
              f"{_gpus_line(capabilities)} simulated, {_emulated(args.backend)} emulated.")
        shown = cases[0][1]  # the split tables' input scales are shared unless --spread
        print(f"Fixture: E={shown.num_experts} H={shown.hidden} I={shown.intermediate} "
              f"top-{shown.top_k}, {shown.tokens} tokens/rank, per-expert input scales "
              f"spread {shown.input_scale_spread:g}x, seed {shown.seed}.")
        if args.gate_up_split:
            print("Gate/up split: each half quantized from its own amax, the up masters up to "
                  "the ratio x the gate's (each expert log-uniform in it); the reference "
                  "dequantizes each half with its own global scale.")
        print("Errors are ||out - ref|| / ||ref|| against the ideal NVFP4 reference of the "
              "layout; 'noise floor' is that reference against fp32.\n")
        print(format_table(rows, with_capability=len(capabilities) > 1,
                           with_case=bool(args.gate_up_split)))
        for r in rows:
            for mode, err in (("stock", r.stock_error), ("plugin", r.plugin_error)):
                if err:
                    at = f" at {r.capability}" if len(capabilities) > 1 else ""
                    print(f"{mode} {r.format}/{r.layout}/{r.backend}{at} cannot run: {err}")
    return EXIT_OK if all(r.ok for r in rows) else EXIT_FINDING


def _uncalibrated_table(args: argparse.Namespace, layouts, formats) -> int:
    """``matrix --uncalibrated``: one planted expert per row (simulation/uncalibrated.py)."""
    from fp4_moe_lab.simulation import uncalibrated
    from fp4_moe_lab.simulation.matrix import installed_release

    start = time.monotonic()
    rows = uncalibrated.run_uncalibrated(layouts or uncalibrated.DEFAULT_LAYOUTS,
                                         formats=formats, progress=progress)
    progress(f"matrix --uncalibrated: {len(rows)} rows in {time.monotonic() - start:.0f} s")
    if args.save_json:
        try:
            with open(args.save_json, "w") as f:
                json.dump(rows, f, indent=2)
        except OSError as exc:
            raise UsageError(f"--save-json {args.save_json}: cannot write "
                             f"({exc.strerror or exc}); choose another path") from None
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        version, design = installed_release()
        print(f"Uncalibrated experts: real vLLM {version} code on CPU "
              f"({design.label if design else 'inactive plugin'}), SM100 simulated. One expert "
              "planted per row: its GEMM1 (w13) or GEMM2 (w2) input scale as a quantizer writes "
              "it for an expert no calibration token reached (zero: 0.0; tiny: 1.57e-29 "
              "compressed-tensors, the same amax in ModelOpt), or a rare expert's large "
              f"calibrated amax (large: {uncalibrated.LARGE_FACTOR:g}x). Errors against the "
              "ideal NVFP4 reference of the layer with the calibrated experts' max amax for "
              "the uncalibrated one.\n")
        print(uncalibrated.format_table(rows))
    return EXIT_OK if all(r["ok"] for r in rows) else EXIT_FINDING


def _parse_set(items: Sequence[str]) -> dict:
    sizes = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"--set {item!r}: expected KEY=INT, e.g. --set hidden_size=512")
        try:
            sizes[key] = int(value.strip(), 10)
        except ValueError:
            raise UsageError(f"--set {item!r}: {value!r} is not an integer; values are plain "
                             "integers (see --help for the keys)") from None
    return sizes


def _cmd_make_checkpoint(args: argparse.Namespace) -> int:
    from fp4_moe_lab.checkpoint.writer_limits import output_dir_problem

    problem = output_dir_problem(Path(args.out), args.overwrite)
    if problem:
        fix = ("pass --overwrite to replace it, or choose another OUT"
               if "already holds" in problem else "choose another OUT")
        raise UsageError(f"OUT {args.out}: {problem}; {fix}")
    sizes = _parse_set(args.set or [])
    from fp4_moe_lab.checkpoint import configs
    from fp4_moe_lab.checkpoint.writer import check_request, write_checkpoint

    base = configs.BASE_CONFIGS[args.arch]
    for key in sizes:
        if key not in base or not isinstance(base[key], int) or isinstance(base[key], bool):
            ints = sorted(k for k, v in base.items()
                          if isinstance(v, int) and not isinstance(v, bool))
            raise UsageError(f"--set {key}: not an integer config.json key of --arch "
                             f"{args.arch}; choose from {', '.join(ints)}")
    try:
        check_request(fmt=args.format, arch=args.arch, input_scale_spread=args.spread,
                      shard_size_bytes=args.shard_size_bytes, **sizes)
    except ValueError as exc:
        flag = "--spread" if str(exc).startswith("input_scale_spread") else "--set"
        raise UsageError(f"{flag}: {exc}") from None
    try:
        manifest = write_checkpoint(args.out, fmt=args.format, arch=args.arch, seed=args.seed,
                                    input_scale_spread=args.spread, overwrite=args.overwrite,
                                    shard_size_bytes=args.shard_size_bytes, **sizes)
    except OSError as exc:  # disk full, permissions changed under us, ...
        raise UsageError(f"OUT {args.out}: cannot write {exc.filename or ''} "
                         f"({exc.strerror or exc}); free space or choose another OUT") from None
    if args.json:
        print(json.dumps(manifest, indent=2, default=str))
    else:
        size = sum(manifest["files_bytes"].values()) / 1e6
        print(f"wrote {manifest['arch']} / {manifest['format']} checkpoint to "
              f"{manifest['out_dir']} ({size:.1f} MB, {len(manifest['layers'])} MoE layers, "
              f"per-expert input scales spread {manifest['input_scale_spread']:g}x)")
    return EXIT_OK


def _cmd_demo(args: argparse.Namespace) -> int:
    from fp4_moe_lab.checkpoint.writer_limits import output_dir_problem
    from fp4_moe_lab.demo import CHECKPOINT_NAME, run_demo

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {args.out}: exists and is not a directory; choose a directory")
    problem = output_dir_problem(out / CHECKPOINT_NAME, overwrite=True)
    if problem:
        raise UsageError(f"--out {args.out}: {problem}; choose another --out")
    return run_demo(out, engine=not args.no_engine, progress=progress)


COMMANDS = {"matrix": _cmd_matrix, "make-checkpoint": _cmd_make_checkpoint, "demo": _cmd_demo}
