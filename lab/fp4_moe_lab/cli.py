# SPDX-License-Identifier: Apache-2.0
"""vllm-fp4-moe-lab: the development commands (matrix, make-checkpoint, demo), a console script
of the lab package, never of the serving wheel. Same flags, errors and exit codes as the
operator's ``vllm-fp4-moe`` (its :func:`~vllm_fp4_moe_plugin.tools.cli.run_command`); the commands
themselves are in :mod:`fp4_moe_lab.commands`.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Sequence

from fp4_moe_lab.simulation.gpus import DEFAULT_CAPABILITY, GPUS
from vllm_fp4_moe_plugin.scales.nvfp4_constants import MAX_INPUT_SCALE_SPREAD
from vllm_fp4_moe_plugin.tools.cli import FORMATS, CliParser, add_common_flags, int_in, run_command

# the fixture's largest up/gate weight-scale ratio (the field's exports reach 10x)
MAX_GATE_UP_SPLIT = 1000.0

PROG = "vllm-fp4-moe-lab"
ARCHS = ("qwen3_moe", "deepseek_v3")
MAX_MATRIX_TOKENS = 8192  # per rank; the CPU emulator holds [tokens, E, I] intermediates
SET_HELP = ("override an integer config.json key of --arch, KEY=INT (repeatable), e.g. "
            "--set moe_intermediate_size=512. Keys: hidden_size, moe_intermediate_size and "
            "intermediate_size (multiples of 16), num_hidden_layers, vocab_size, "
            "num_experts_per_tok, num_attention_heads, num_key_value_heads; qwen3_moe: "
            "num_experts, head_dim, decoder_sparse_step; deepseek_v3: n_routed_experts, "
            "n_shared_experts, n_group, topk_group, first_k_dense_replace, q_lora_rank, "
            "kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim. Any other integer key "
            "of the arch's config.json is accepted too; values are plain integers")


def _gate_up_split(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or not 1.0 < value <= MAX_GATE_UP_SPLIT:
        raise argparse.ArgumentTypeError(
            f"{text} must be a number above 1 and at most {MAX_GATE_UP_SPLIT:g} (the largest "
            "ratio of an up half's weight global scale to its gate's)")
    return value


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
    """``matrix --capability``: one of the GPUs the oracle seam simulates (simulation/gpus.py)."""
    from fp4_moe_lab.simulation.gpus import parse_capability

    try:
        parse_capability(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _run(args: argparse.Namespace) -> int:
    from fp4_moe_lab import commands

    return commands.run(args)


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog=PROG, description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    m = sub.add_parser("matrix", help="stock vs plugin in every layout, on real vLLM code (CPU)")
    m.add_argument("--json", action="store_true", help="print the rows as a JSON list")
    m.add_argument("--save-json", metavar="PATH", help="also write the rows as JSON to PATH")
    m.add_argument("--layout", action="append",
                   help="only this layout (repeatable): single, pp, tp, tp_ep, tp_all2allv, "
                   "dp_ep_allgather, dp_ep_all2allv, dp")
    m.add_argument("--format", action="append", choices=FORMATS)
    m.add_argument("--backend", action="append",
                   choices=("flashinfer_cutlass", "flashinfer_trtllm", "auto",
                            "vllm_cutlass"),
                   help="only this FlashInfer MoE backend (repeatable; default: both, "
                   "TRT-LLM where the installed vLLM has that path); auto: vLLM's own pick "
                   "(--moe-backend auto, 0.20.0+), checked against the support model's; "
                   "vllm_cutlass: vLLM's own CUTLASS kernel (--moe-backend cutlass, "
                   "per-expert scales; read on 0.34.0), only when named")
    m.add_argument("--capability", type=_capability, action="append",
                   help="the Blackwell GPU reported to vLLM (repeatable; other than "
                   f"{DEFAULT_CAPABILITY}: vLLMs whose experts ask their own device probe, "
                   "read on 0.34.0): "
                   f"{', '.join(f'{c} {g}' for c, g in GPUS.items())} "
                   f"(default {DEFAULT_CAPABILITY}); vLLM's own checks then decide what it builds")
    m.add_argument("--seed", type=int_in(0, 2 ** 31 - 1), default=0)
    m.add_argument("--spread", type=_spread, default=None,
                   help="max/min of the per-expert input scales (default 4, 1 with "
                   "--gate-up-split; 1 to 229376)")
    m.add_argument("--tokens", type=int_in(1, MAX_MATRIX_TOKENS), default=32,
                   help=f"tokens per rank (default 32; 1 to {MAX_MATRIX_TOKENS})")
    m.add_argument("--gate-up-split", type=_gate_up_split, action="append", metavar="RATIO",
                   help="instead: rows whose experts' up weights have their own global scale, "
                   "up to RATIO x the gate's (repeatable; published GLM exports: up to 10; "
                   "default layouts single and dp_ep_allgather)")
    m.add_argument("--non-gated", action="store_true",
                   help="the experts non-gated relu2 (Nemotron-H: up_proj and down_proj, "
                   "vLLM's activation relu2_no_mul; vLLM 0.34.0's MoE factory); FlashInfer "
                   "CUTLASS only, the TRT-LLM kernel's non-gated path is not emulated")
    m.add_argument("--router-weight-on-input", action="store_true",
                   help="Llama-4's MoE: top-1, its routing (top-k then sigmoid), the router "
                   "weight applied to the input before GEMM1 (the reference applies it once), "
                   "and its shared expert beside the routed ones (on the unweighted input); "
                   "kernels: flashinfer_cutlass (default), vllm_cutlass, flashinfer_trtllm "
                   "(DP+EP layouts: its modular experts)")
    m.add_argument("--shared-expert", action="store_true",
                   help="a shared expert beside the routed ones, handed to the layer as "
                   "DeepSeek's, GLM's and Qwen3-Next's model files hand theirs (the router "
                   "weight on the output; --router-weight-on-input always has one)")
    m.add_argument("--uncalibrated", action="store_true",
                   help="instead: the uncalibrated-expert table (default layouts single and "
                   "dp_ep_allgather; one expert's input scale in each reported value class: 0, "
                   "1.57e-29, NaN, inf, denormal, negative, missing; or legitimately large)")

    c = sub.add_parser("make-checkpoint", help="write a tiny deterministic NVFP4 MoE checkpoint")
    c.add_argument("out", metavar="OUT", help="output directory (new or empty, or a checkpoint "
                   "this command wrote, with --overwrite)")
    c.add_argument("--format", default="modelopt", choices=FORMATS)
    c.add_argument("--arch", default="qwen3_moe", choices=ARCHS)
    c.add_argument("--spread", type=_spread, default=4.0,
                   help="max/min of the per-expert input scales of every MoE layer (default 4; "
                   "1 to 229376, exactly representable in float32)")
    c.add_argument("--seed", type=int_in(0, 2 ** 32 - 1), default=0)
    c.add_argument("--shard-size-bytes", type=int_in(1), default=None,
                   help="split into shards with model.safetensors.index.json")
    c.add_argument("--set", action="append", metavar="KEY=INT", help=SET_HELP)
    c.add_argument("--overwrite", action="store_true",
                   help="replace a checkpoint this command wrote in OUT")
    c.add_argument("--json", action="store_true", help="print the manifest as JSON")

    d = sub.add_parser("demo", help="tiny checkpoint -> audit -> stock vs plugin (CPU)")
    d.add_argument("--out", default="demo-output", help="where the checkpoint is written")
    d.add_argument("--no-engine", action="store_true",
                   help="show real vLLM layers (the matrix) even if .venv-engine exists")
    for p in (m, c, d):
        p.set_defaults(func=_run)
        add_common_flags(p, top=False)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_command(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
