# SPDX-License-Identifier: Apache-2.0
"""The CLI's argument checks: bad arguments and missing paths are exit 2 with one line naming
the input, before any slow work (no vLLM, no torch: the unit tier runs these), and the exit codes
are distinct. The rest of the exit-code contract: tests/tools/test_cli_errors.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_fp4_moe_plugin.tools import cli

REPO = Path(__file__).resolve().parents[2]
# the checkout's two packages: the plugin and the lab (lab/fp4_moe_lab)
CHECKOUT_PATH = os.pathsep.join([str(REPO), str(REPO / "lab")])



LAB_COMMANDS = ("matrix", "make-checkpoint", "demo")  # vllm-fp4-moe-lab's


def run(capsys, *args):
    """``main`` of the script that has the command, in-process: (exit code, stdout, stderr)."""
    from fp4_moe_lab import cli as lab_cli

    main = lab_cli.main if args and args[0] in LAB_COMMANDS else cli.main
    try:
        code = main([str(a) for a in args])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def run_process(*args, env=None, timeout=300):
    full = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, **(env or {})}
    command = next((str(a) for a in args if not str(a).startswith("-")), "")
    module = "fp4_moe_lab.cli" if command in LAB_COMMANDS else "vllm_fp4_moe_plugin.tools.cli"
    return subprocess.run([sys.executable, "-m", module, *map(str, args)],
                          capture_output=True, text=True, env=full, timeout=timeout)


def assert_bad_input(code, err, *fragments):
    assert code == cli.EXIT_BAD_INPUT, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err  # one line, argparse style
    assert lines[0].startswith("vllm-fp4-moe") and ": error: " in lines[0], lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


@pytest.mark.parametrize("args, fragments", [
    (["doctor", "--tp", "0"], ["--tp", "0 must be >= 1"]),
    (["doctor", "--tp", "-1"], ["--tp", "-1 must be >= 1"]),
    (["doctor", "--dp", "0", "--ep"], ["--dp", "0 must be >= 1"]),
    (["doctor", "--pp", "x"], ["--pp", "'x' is not an integer"]),
    (["doctor", "--capability", "99.9"], ["--capability", "99.9 is not a CUDA compute"]),
    (["doctor", "--capability", "abc"], ["--capability", "MAJOR.MINOR"]),
    (["audit", "somewhere", "--ep-size", "0"], ["--ep-size", "0 must be >= 1"]),
    (["audit", "somewhere", "--expert-placement", "random"], ["--expert-placement"]),
    (["make-checkpoint", "x", "--spread", "1e9"], ["--spread", "exceeds 229376", "E4M3"]),
    (["make-checkpoint", "x", "--spread", "nan"], ["--spread", "finite"]),
    (["make-checkpoint", "x", "--spread", "inf"], ["--spread", "finite"]),
    (["make-checkpoint", "x", "--spread", "0.5"], ["--spread", ">= 1"]),
    (["make-checkpoint", "x", "--shard-size-bytes", "0"], ["--shard-size-bytes"]),
    (["matrix", "--spread", "0"], ["--spread", ">= 1"]),
    (["matrix", "--tokens", "0"], ["--tokens", "between 1 and"]),
    (["matrix", "--tokens", "-5"], ["--tokens"]),
    (["matrix", "--seed", "-1"], ["--seed"]),
    (["matrix", "--format", "gguf"], ["--format"]),
    (["bogus"], ["invalid choice"]),
])
def test_bad_arguments_exit_2_with_one_line(capsys, args, fragments):
    code, out, err = run(capsys, *args)
    assert_bad_input(code, err, *fragments)
    assert out == ""


def test_bad_arguments_in_a_real_process():
    r = run_process("doctor", "--capability", "99.9")
    assert_bad_input(r.returncode, r.stderr, "--capability")


@pytest.mark.parametrize("args", [["audit", "/nonexistent/ckpt", "--vllm", "0.34.0"],
                                  ["doctor", "--checkpoint", "/nonexistent/ckpt"]])
def test_missing_checkpoint_directory(capsys, args):
    code, _, err = run(capsys, *args)
    assert_bad_input(code, err, "/nonexistent/ckpt", "does not exist")


def test_exit_codes_are_distinct():
    codes = {cli.EXIT_OK, cli.EXIT_FINDING, cli.EXIT_BAD_INPUT, cli.EXIT_INTERNAL}
    assert len(codes) == 4
    from vllm_fp4_moe_plugin.tools import doctor

    assert cli.EXIT_INTERNAL not in doctor.VERDICTS  # no subcommand returns it as a result


@pytest.mark.parametrize("command", LAB_COMMANDS)
def test_the_operators_script_has_no_development_commands(capsys, command):
    """matrix, demo and make-checkpoint are the lab's (``vllm-fp4-moe-lab``): the serving
    script refuses them like any unknown command, and nothing of the lab is imported."""
    sys.modules.pop("fp4_moe_lab.commands", None)
    try:
        code = cli.main([command])
    except SystemExit as exc:
        code = exc.code
    _, err = capsys.readouterr()
    assert_bad_input(code, err, "invalid choice", f"'{command}'")
    assert "fp4_moe_lab.commands" not in sys.modules
