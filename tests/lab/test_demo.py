# SPDX-License-Identifier: Apache-2.0
"""The demo's engine mode is for repository checkouts only: when it runs, and why not."""

from pathlib import Path

from fp4_moe_lab import checkout, demo
from fp4_moe_lab.engines import engine, plugin_wheel

ROOT = Path(__file__).resolve().parents[2]


def _fake_checkout(root: Path, *, venv_engine: bool) -> None:
    (root / "lab").mkdir(parents=True)
    (root / "setup.cfg").touch()
    (root / "lab" / "pyproject.toml").touch()
    if venv_engine:
        (root / ".venv-engine" / "bin").mkdir(parents=True)
        (root / ".venv-engine" / "bin" / "python").touch()


def test_the_lab_knows_this_checkout():
    assert checkout.ROOT == ROOT and checkout.is_checkout()


def test_installed_package_has_no_engine_runner(tmp_path, monkeypatch):
    monkeypatch.setattr(checkout, "ROOT", tmp_path)  # e.g. site-packages
    runner, why = demo._engine_runner()
    assert runner is None and "not run from a repository checkout" in why
    assert "\n" not in why


def test_checkout_without_venv_engine(tmp_path, monkeypatch):
    _fake_checkout(tmp_path, venv_engine=False)
    monkeypatch.setattr(checkout, "ROOT", tmp_path)
    runner, why = demo._engine_runner()
    assert runner is None and ".venv-engine not built" in why and "--with-engine" in why


def test_checkout_with_venv_engine_gives_the_runner(tmp_path, monkeypatch):
    _fake_checkout(tmp_path, venv_engine=True)
    monkeypatch.setattr(checkout, "ROOT", tmp_path)
    # a world whose plugin wheel is current (the real check: the next test)
    monkeypatch.setattr(plugin_wheel, "check", lambda venv, world: None)
    runner, why = demo._engine_runner()
    assert why == "" and runner is engine
    assert runner.engine_python() == tmp_path / ".venv-engine" / "bin" / "python"
    assert {"ACTIVE_LINE", "run_engine", "max_logprob_gap"} <= set(vars(runner))


def test_engine_demo_is_skipped_with_the_fix_when_the_worlds_wheel_is_stale(tmp_path,
                                                                             monkeypatch):
    _fake_checkout(tmp_path, venv_engine=True)
    monkeypatch.setattr(checkout, "ROOT", tmp_path)
    runner, why = demo._engine_runner()  # no .plugin-wheel stamp: never built from this source
    assert runner is None and "./scripts/bootstrap-engine.sh 0.11.0" in why
