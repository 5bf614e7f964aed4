# SPDX-License-Identifier: Apache-2.0
"""``vllm-fp4-moe-lab demo``: the whole story on a built-in tiny checkpoint, in a few minutes.

1. write a tiny NVFP4 Qwen3-MoE checkpoint whose experts have different input scales;
2. audit it (scale tensors only): would stock vLLM 0.11.0 compute it wrongly?
3. show stock vs plugin on it: in a real vLLM 0.11.0 CPU engine when run from a repository
   checkout that has ``.venv-engine`` (``./scripts/bootstrap.sh --with-engine``), otherwise on
   real vLLM layers (the matrix).

The engine mode needs the checkout's ``.venv-engine`` (``fp4_moe_lab.engines.engine`` drives
``engine_run.py`` in it); without it the demo says why and shows the matrix.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

from fp4_moe_lab import checkout

MATRIX_LAYOUTS = ("single", "tp_ep", "dp_ep_allgather")
CHECKPOINT_NAME = "qwen3_moe-modelopt-nvfp4"  # under --out


def _no_progress(text: str) -> None:
    return None


def _engine_runner() -> tuple[Optional[ModuleType], str]:
    """(``fp4_moe_lab.engines.engine``, "") when the engine demo can run here; else (None, why
    not, in one line)."""
    root = checkout.ROOT
    if not checkout.is_checkout(root):
        return None, (f"not run from a repository checkout ({root} is not one): the engine demo "
                      "needs one, with `./scripts/bootstrap.sh --with-engine`")
    if not (root / ".venv-engine" / "bin" / "python").exists():
        return None, (f"{root / '.venv-engine'} not built: `./scripts/bootstrap.sh "
                      "--with-engine` enables the engine demo")
    from fp4_moe_lab.engines import engine, plugin_wheel

    try:  # the engine loads .venv-engine's plugin wheel: it must be built from this source
        plugin_wheel.check(root / ".venv-engine", "0.11.0")
    except RuntimeError as e:
        return None, str(e)
    return engine, ""


def _engine_section(engine: ModuleType, checkpoint: Path, say: Callable[[str], None],
                    progress: Callable[[str], None] = _no_progress) -> bool:
    ACTIVE_LINE, max_logprob_gap, run_engine = (engine.ACTIVE_LINE, engine.max_logprob_gap,
                                                engine.run_engine)
    runs = {}
    for name, plugin, kernel in (("reference", "1", "reference"), ("plugin", "1", "emulator"),
                                 ("stock", "0", "emulator")):
        say(f"  running vllm.LLM ({name}) ...")
        progress(f"demo: step 3, engine run {len(runs) + 1}/3 ({name}) ...")
        runs[name], log = run_engine(checkpoint, plugin=plugin, kernel=kernel)
        if name == "plugin":
            say(f"    vLLM loaded the plugin itself: {log.count(ACTIVE_LINE)} process(es) logged "
                f"'{ACTIVE_LINE}'")
    say("")
    say("  greedy tokens (2 prompts, 6 new tokens each):")
    ok = True
    for i, ref in enumerate(runs["reference"]):
        plugin, stock = runs["plugin"][i], runs["stock"][i]
        say(f"    prompt {i}: reference {ref['tokens']}")
        say(f"              plugin    {plugin['tokens']}  "
            f"(max logprob gap {max_logprob_gap(plugin, ref):.3g})")
        say(f"              stock     {stock['tokens']}  "
            f"(max logprob gap {max_logprob_gap(stock, ref):.3g})")
        ok &= plugin["tokens"] == ref["tokens"]
    say("  reference = same engine, every MoE layer computing the ideal NVFP4 answer with a plain "
        "loop over experts.")
    return ok


def _matrix_section(why: str, say: Callable[[str], None],
                    progress: Callable[[str], None] = _no_progress) -> bool:
    from fp4_moe_lab.simulation.layouts import Scenario
    from fp4_moe_lab.simulation.matrix import format_table, run_matrix

    say(f"  (real vLLM 0.11.0 MoE layers instead of a whole engine: {why})")
    rows = []
    for i, name in enumerate(MATRIX_LAYOUTS, 1):
        progress(f"demo: step 3, layout {i}/{len(MATRIX_LAYOUTS)} ({name}) ...")
        rows.extend(run_matrix([name], Scenario(), backends=("flashinfer_cutlass",)))
    say(format_table(rows))
    say("  errors: ||out - ideal|| / ||ideal||; 'noise floor' = what NVFP4 itself costs.")
    return all(r.ok for r in rows)


def run_demo(out_dir: Path, say: Callable[[str], None] = print, *, engine: bool = True,
             progress: Callable[[str], None] = _no_progress) -> int:
    """The demo; ``say`` prints the story (stdout), ``progress`` one line per slow step
    (the CLI sends it to stderr)."""
    from fp4_moe_lab.checkpoint.writer import write_checkpoint
    from vllm_fp4_moe_plugin.tools.checkpoint.audit import audit_checkpoint
    from vllm_fp4_moe_plugin.tools.checkpoint.render import format_audit

    checkpoint = Path(out_dir) / CHECKPOINT_NAME
    progress("demo: step 1/3, writing the checkpoint ...")
    say("== 1. A tiny NVFP4 MoE checkpoint (ModelOpt format, Qwen3-MoE shape)")
    manifest = write_checkpoint(checkpoint, fmt="modelopt", arch="qwen3_moe", seed=0,
                                input_scale_spread=4.0, overwrite=True,
                                moe_intermediate_size=512)
    size = sum(manifest["files_bytes"].values()) / 1e6
    say(f"  {checkpoint} ({size:.1f} MB): {len(manifest['layers'])} MoE layers, experts' input "
        "scales differ by up to 4x, as in calibrated checkpoints such as "
        "DeepSeek-R1-0528-FP4-v2.")
    say("")
    say("== 2. Audit: what would stock vLLM 0.11.0 do with it? (reads scale tensors only)")
    progress("demo: step 2/3, auditing it ...")
    say(format_audit(audit_checkpoint(checkpoint)))
    say("")
    say("== 3. Stock vLLM 0.11.0 vs vLLM 0.11.0 + this plugin, same checkpoint, same inputs")
    say("  SM100 (Blackwell) is simulated: FlashInfer 0.3.1's NVFP4 MoE kernel is replaced by "
        "this project's emulator of its contract. A Blackwell owner confirms with "
        "examples/eval_gsm8k.sh.")
    runner, why = _engine_runner() if engine else (None, "--no-engine")
    progress("demo: step 3/3, stock vs plugin (minutes on CPU) ...")
    ok = (_engine_section(runner, checkpoint, say, progress) if runner is not None
          else _matrix_section(why, say, progress))
    say("")
    say("RESULT: " + ("the plugin reproduces the correct NVFP4 answer; stock does not."
                      if ok else "UNEXPECTED: the plugin did not match the reference."))
    return 0 if ok else 1
