# SPDX-License-Identifier: Apache-2.0
"""The exit-code contract: 0 fine, 1 a finding, 2 bad input (one line on stderr
naming the input), 70 internal error (traceback only with --debug / VLLM_FP4_MOE_DEBUG=1).

One parametrized test per class of bad input. Most call a script's ``main`` in-process (the
same code path as the console script, without a new interpreter); a few run the real
``python -m`` to prove the process-level behaviour (exit status, nothing but one line on
stderr)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from fp4_moe_lab.checkpoint.writer import write_checkpoint
from tests.ut.test_cli_args import assert_bad_input, run, run_process
from vllm_fp4_moe_plugin.tools import cli

REPO = Path(__file__).resolve().parents[2]
# the checkout's two packages: the plugin and the lab (lab/fp4_moe_lab)
CHECKOUT_PATH = os.pathsep.join([str(REPO), str(REPO / "lab")])


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small single-file ModelOpt checkpoint with uniform scales (audit: not affected)."""
    root = tmp_path_factory.mktemp("cli-errors")
    write_checkpoint(root / "uniform", fmt="modelopt", arch="qwen3_moe", input_scale_spread=1.0)
    write_checkpoint(root / "sharded", fmt="modelopt", arch="qwen3_moe",
                     shard_size_bytes=2 * 1024 * 1024)
    return root


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


# --- 1. bad arguments: rejected before any slow work -------------------------------------

def test_matrix_unknown_layout_is_refused_before_spawning(capsys, tmp_path, monkeypatch):
    from fp4_moe_lab.simulation import layouts

    monkeypatch.setattr(layouts, "spawn", lambda *a, **k: pytest.fail("spawned a rank"))
    code, _, err = run(capsys, "matrix", "--layout", "bogus")
    assert_bad_input(code, err, "--layout bogus", "single")
    code, _, err = run(capsys, "matrix", "--layout", "single", "--save-json",
                       tmp_path / "missing" / "rows.json")
    assert_bad_input(code, err, "--save-json", "does not exist")
    # --moe-backend auto is a KernelConfig field of 0.20.0+, not of this design's releases
    code, _, err = run(capsys, "matrix", "--layout", "single", "--backend", "auto")
    assert_bad_input(code, err, "--backend auto", "name the backend")
    # non-gated experts: only FlashInfer CUTLASS's Relu2 contract is emulated
    code, _, err = run(capsys, "matrix", "--non-gated", "--backend", "flashinfer_trtllm")
    assert_bad_input(code, err, "--non-gated", "--backend flashinfer_cutlass")
    code, _, err = run(capsys, "matrix", "--non-gated", "--gate-up-split", "4")
    assert_bad_input(code, err, "--non-gated", "no gate/up pair")


# --- 2. bad checkpoints: exit 2, the file or tensor named --------------------------------

def _damage_single(root: Path, tmp_path: Path, how: str) -> tuple[Path, str]:
    ck = _copy(root / "uniform", tmp_path / how)
    f = ck / "model.safetensors"
    name = "model.layers.1.mlp.experts.3.down_proj"
    if how in ("truncated", "empty"):
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if how == "truncated" else b"")
        return ck, "model.safetensors: not a readable safetensors file"
    tensors = load_file(str(f))
    if how == "nan_weight_scale":
        tensors[f"{name}.weight_scale_2"] = torch.tensor(float("nan"))
        fragment = f"{name}.weight_scale_2' is NaN"
    elif how == "zero_weight_scale":
        tensors[f"{name}.weight_scale_2"] = torch.tensor(0.0)
        fragment = f"{name}.weight_scale_2' is zero"
    elif how == "negative_weight_scale":
        tensors[f"{name}.weight_scale_2"] = torch.tensor(-1.0)
        fragment = f"{name}.weight_scale_2' is negative"
    elif how == "float8_input_scale":
        tensors[f"{name}.input_scale"] = torch.tensor(0.5).to(torch.float8_e4m3fn)
        fragment = f"{name}.input_scale' has dtype"
    elif how == "inf_weight_scale":
        tensors[f"{name}.weight_scale_2"] = torch.tensor(float("inf"))
        fragment = f"{name}.weight_scale_2' is inf"
    elif how in ("int32_input_scale", "bool_input_scale"):
        dtype = torch.int32 if how.startswith("int32") else torch.bool
        tensors[f"{name}.input_scale"] = torch.tensor(1, dtype=dtype)
        fragment = f"{name}.input_scale' has dtype"
    elif how == "vector_input_scale":
        tensors[f"{name}.input_scale"] = torch.ones(4)
        fragment = f"{name}.input_scale' has shape [4]"
    else:
        raise AssertionError(how)
    save_file(tensors, str(f), metadata={"format": "pt"})
    return ck, fragment


@pytest.mark.parametrize("how", ["truncated", "empty", "nan_weight_scale", "inf_weight_scale",
                                 "zero_weight_scale", "negative_weight_scale",
                                 "int32_input_scale", "bool_input_scale", "float8_input_scale",
                                 "vector_input_scale"])
def test_bad_checkpoint_is_exit_2_naming_file_or_tensor(capsys, ckpt, tmp_path, how):
    path, fragment = _damage_single(ckpt, tmp_path, how)
    code, out, err = run(capsys, "audit", path)
    assert_bad_input(code, err, "bad checkpoint", fragment)
    assert out == ""


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan")])
def test_uncalibrated_input_scale_is_a_finding_not_bad_input(capsys, ckpt, tmp_path, value):
    """An activation scale no calibration produced (what llmcompressor writes for an expert it
    never calibrated) is exit 1, a finding naming the expert; the plugin repairs it at load."""
    ck = _copy(ckpt / "uniform", tmp_path / "uncal")
    f = ck / "model.safetensors"
    tensors = load_file(str(f))
    tensors["model.layers.1.mlp.experts.3.down_proj.input_scale"] = torch.tensor(value)
    save_file(tensors, str(f), metadata={"format": "pt"})
    code, out, err = run(capsys, "audit", ck)
    assert code == cli.EXIT_FINDING, err
    assert "uncalibrated w2 input scale: expert(s) [3]" in out


@pytest.mark.parametrize("how", ["truncated", "empty", "missing"])
def test_bad_shard_is_named(capsys, ckpt, tmp_path, how):
    ck = _copy(ckpt / "sharded", tmp_path / "sharded")
    shards = sorted(ck.glob("model-*.safetensors"))
    bad = shards[-1]
    if how == "missing":
        bad.unlink()
    else:
        data = bad.read_bytes()
        bad.write_bytes(data[:100] if how == "truncated" else b"")
    code, _, err = run(capsys, "audit", ck)
    assert_bad_input(code, err, bad.name)


def test_bad_checkpoint_in_doctor_is_exit_2_before_vllm(ckpt, tmp_path):
    path, fragment = _damage_single(ckpt, tmp_path, "nan_weight_scale")
    r = run_process("doctor", "--checkpoint", path, "--capability", "10.0")
    assert_bad_input(r.returncode, r.stderr, "--checkpoint", fragment)


def test_bad_checkpoint_in_a_real_process(ckpt, tmp_path):
    path, _ = _damage_single(ckpt, tmp_path, "truncated")
    r = run_process("audit", path)
    assert_bad_input(r.returncode, r.stderr, "model.safetensors")


@pytest.mark.parametrize("damage, fragment", [
    (lambda f: (f.unlink(), f.mkdir()), "cannot read config.json"),
    (lambda f: f.write_bytes(b"\xff\xfe\x00binary"), "not UTF-8 text"),
    (lambda f: f.write_text("{"), "invalid JSON"),
    (lambda f: f.write_text("[1]"), "must be a JSON object"),
])
def test_unreadable_config_is_named(capsys, ckpt, tmp_path, damage, fragment):
    ck = _copy(ckpt / "uniform", tmp_path / "c")
    damage(ck / "config.json")
    code, _, err = run(capsys, "audit", ck)
    assert_bad_input(code, err, "config.json", fragment)


# --- 3. findings: exit 1, with the reason --------------------------------------------------

@pytest.mark.parametrize("args, reason", [
    (["--ep-size", "3"], "16 experts are not divisible by EP size 3"),
    (["--expert-placement", "round_robin"], "round_robin expert placement"),
])
def test_layouts_flashinfer_cannot_compute_are_a_finding(capsys, ckpt, args, reason):
    code, out, err = run(capsys, "audit", ckpt / "uniform", *args)
    assert code == cli.EXIT_FINDING and "Traceback" not in err
    assert reason in out and "AFFECTED" in out
    code, out, _ = run(capsys, "audit", ckpt / "uniform")
    assert code == cli.EXIT_OK and "not affected" in out


@pytest.mark.parametrize("env, reason", [
    ({"VLLM_FP4_MOE_PLUGIN": "yes"}, "VLLM_FP4_MOE_PLUGIN='yes' is not a valid value"),
    ({"VLLM_FP4_MOE_PLUGIN": "1", "VLLM_FP4_MOE_PLUGIN_CHECK": "bogus"},
     "VLLM_FP4_MOE_PLUGIN_CHECK='bogus' is not a valid value"),
    ({"VLLM_FP4_MOE_PLUGIN": "1", "VLLM_PLUGINS": "other, fp4_moe"},
     "' fp4_moe' does not match"),
])
def test_doctor_settings_vllm_would_reject_are_at_risk_with_reason(capsys, blackwell_env, ckpt,
                                                                  tmp_path, env, reason):
    spread = tmp_path / "spread"
    write_checkpoint(spread, fmt="modelopt", arch="qwen3_moe")
    for k, v in env.items():
        blackwell_env.setenv(k, v)
    code, out, err = run(capsys, "doctor", "--checkpoint", spread, "--tp", "2", "--ep",
                         "--capability", "10.0")
    assert code == cli.EXIT_FINDING, out + err
    assert "Traceback" not in err and "verdict: AT RISK" in out
    assert "because: " in out and reason in out


# --- 4. make-checkpoint output paths and --set ---------------------------------------------

def test_make_checkpoint_into_an_existing_checkpoint_names_the_flag(capsys, ckpt):
    code, _, err = run(capsys, "make-checkpoint", ckpt / "uniform")
    assert_bad_input(code, err, "already holds a checkpoint", "--overwrite")
    assert "overwrite=True" not in err


@pytest.mark.parametrize("make, fragment", [
    (lambda p: p.write_text("x") and p, "exists and is not a directory"),
    (lambda p: (p.write_text("x"), p / "sub")[1], "is not a directory, so"),
    (lambda p: (p.mkdir(), (p / "notes.txt").write_text("x"), p)[2], "did not create"),
])
def test_make_checkpoint_unusable_output_path(capsys, tmp_path, make, fragment):
    out = make(tmp_path / "target")
    code, _, err = run(capsys, "make-checkpoint", out)
    assert_bad_input(code, err, "OUT", fragment)


@pytest.mark.parametrize("item, fragment", [
    ("num_experts=abc", "'abc' is not an integer"),
    ("num_experts=8.0", "is not an integer"),
    ("num_experts", "expected KEY=INT"),
    ("bogus_key=3", "--set bogus_key: not an integer config.json key"),
    ("torch_dtype=3", "--set torch_dtype: not an integer config.json key"),
    ("hidden_size=100", "hidden_size=100 must be a positive multiple of 16"),
    ("hidden_size=65536", "GiB"),
    ("num_experts=0", "num_experts"),
])
def test_make_checkpoint_bad_set(capsys, tmp_path, item, fragment):
    code, _, err = run(capsys, "make-checkpoint", tmp_path / "c", "--set", item)
    assert_bad_input(code, err, "--set", fragment)
    assert not (tmp_path / "c").exists(), "nothing written for a bad request"


def test_make_checkpoint_help_documents_set_keys(capsys):
    from fp4_moe_lab import cli as lab_cli

    with pytest.raises(SystemExit):
        lab_cli.main(["make-checkpoint", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for text in ("KEY=INT", "moe_intermediate_size", "n_routed_experts", "num_experts",
                 "229376"):
        assert text in out, text


# --- 5. internal errors: exit 70, traceback only when asked ----------------------------------

def _boom(args):
    raise KeyError("surprise")


@pytest.mark.parametrize("debug", ["none", "flag", "env"])
def test_internal_error_is_exit_70_with_traceback_only_when_asked(capsys, monkeypatch, ckpt,
                                                                  debug):
    monkeypatch.setattr(cli, "_cmd_audit", _boom)
    monkeypatch.delenv("VLLM_FP4_MOE_DEBUG", raising=False)
    args = ["audit", ckpt / "uniform"]
    if debug == "flag":
        args.append("--debug")
    elif debug == "env":
        monkeypatch.setenv("VLLM_FP4_MOE_DEBUG", "1")
    code, _, err = run(capsys, *args)
    assert code == cli.EXIT_INTERNAL == 70
    assert "internal error: KeyError" in err and "--debug" in err
    assert ("Traceback" in err) is (debug != "none")


def test_bad_debug_variable_is_bad_input(capsys, monkeypatch, ckpt):
    monkeypatch.setenv("VLLM_FP4_MOE_DEBUG", "yes")
    code, _, err = run(capsys, "audit", ckpt / "uniform")
    assert_bad_input(code, err, "VLLM_FP4_MOE_DEBUG='yes'")


# --- 6. quiet by default, -v shows third-party lines ----------------------------------------

def test_default_output_has_only_our_lines(tmp_path):
    r = run_process("make-checkpoint", tmp_path / "c", "--spread", "2")
    assert r.returncode == 0, r.stderr
    assert r.stderr == "", r.stderr  # no pynvml FutureWarning, no vllm._C line
    assert r.stdout.startswith("wrote qwen3_moe / modelopt checkpoint")
    r = run_process("-v", "make-checkpoint", tmp_path / "d", "--spread", "2")
    assert r.returncode == 0 and "FutureWarning" in r.stderr  # -v: third-party warnings shown


# --- 7. matrix: progress on stderr, nothing left behind (spawns gloo ranks) -----------------

def failing_job(ctx, *args):
    """A rank job that fails after vLLM's groups are up (shared memory created)."""
    raise RuntimeError(f"injected failure in rank {ctx.rank}")


def _leftovers(tmp: Path) -> list:
    return sorted(p.name for p in tmp.iterdir() if p.name.startswith("fp4moe-"))


@pytest.fixture
def short_tmp():
    """An empty TMPDIR of its own with a short path: vLLM's ZMQ IPC sockets live there, and a
    socket path is at most 107 bytes (pytest-xdist's tmp_path is too long for it)."""
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fp4t-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


ROW_KEYS = {"format", "layout", "backend", "stock_rel_err", "plugin_rel_err", "bound",
            "noise_floor", "plugin_fp32_err", "ok"}


@pytest.mark.multiproc
@pytest.mark.slow
def test_matrix_shows_progress_and_leaks_nothing(short_tmp):
    tmp = short_tmp
    r = run_process("matrix", "--layout", "tp", "--format", "modelopt", "--json",
                    env={"TMPDIR": str(tmp)}, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    # vLLM 0.11.0: FlashInfer CUTLASS, and the TRT-LLM backend (ModelOpt only there); rows with
    # the keys the docs and tests read; 0.11.0's TP hole (stock 0.62, the plugin 0.003)
    assert [(row["layout"], row["backend"]) for row in rows] == [
        ("tp", "flashinfer_cutlass"), ("tp", "flashinfer_trtllm")], rows
    for row in rows:
        assert ROW_KEYS <= row.keys() and row["ok"]
        assert row["stock_rel_err"] > 10 * row["plugin_rel_err"], row
    assert "leaked shared_memory" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert "matrix: [1/1] tp ..." in lines and any(" tp done in " in x for x in lines), lines
    assert all(x.startswith("matrix: ") for x in lines), lines  # nothing but our own lines
    assert _leftovers(tmp) == []


@pytest.mark.multiproc
@pytest.mark.slow
def test_failed_ranks_leave_no_log_folder_and_no_shared_memory(short_tmp):
    tmp = short_tmp
    full = {**os.environ, "PYTHONPATH": CHECKOUT_PATH, "TMPDIR": str(tmp)}
    r = subprocess.run([sys.executable, str(REPO / "tests" / "probes" / "spawn_fails.py")],
                       capture_output=True, text=True,
                       env=full, timeout=600, cwd=REPO)
    assert r.returncode == 0 and "FAILED AS INJECTED" in r.stdout, r.stderr[-3000:]
    assert "leaked shared_memory" not in r.stderr, r.stderr[-2000:]
    assert _leftovers(tmp) == []
