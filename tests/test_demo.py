"""The demo's engine mode is for repository checkouts only: when it runs, and why not."""

from pathlib import Path

import pytest

from fp4_moe_lab import demo

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]


def test_checkout_root_is_this_repository():
    assert demo._checkout_root() == ROOT


def test_installed_package_has_no_engine_runner(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "_checkout_root", lambda: tmp_path)  # e.g. site-packages
    runner, why = demo._engine_runner()
    assert runner is None and "not run from a repository checkout" in why
    assert "\n" not in why


def test_checkout_without_venv_engine(tmp_path, monkeypatch):
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "engine" / "engine.py").write_text("raise AssertionError\n")
    monkeypatch.setattr(demo, "_checkout_root", lambda: tmp_path)
    runner, why = demo._engine_runner()
    assert runner is None and ".venv-engine not built" in why and "--with-engine" in why


def test_checkout_with_venv_engine_loads_the_runner_by_path(tmp_path, monkeypatch):
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "engine" / "engine.py").write_text(
        (ROOT / "tests" / "engine" / "engine.py").read_text())
    # a world whose plugin wheel is current (the real check: the next test)
    (tmp_path / "tests" / "engine" / "plugin_wheel.py").write_text(
        "def check(venv, world):\n    pass\n")
    (tmp_path / ".venv-engine" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-engine" / "bin" / "python").touch()
    monkeypatch.setattr(demo, "_checkout_root", lambda: tmp_path)
    runner, why = demo._engine_runner()
    assert why == "" and runner.__file__ == str(tmp_path / "tests" / "engine" / "engine.py")
    assert runner.REPO_ROOT == tmp_path.resolve() and runner.engine_python() is not None
    assert {"ACTIVE_LINE", "run_engine", "max_logprob_gap"} <= set(vars(runner))


def test_engine_demo_is_skipped_with_the_fix_when_the_worlds_wheel_is_stale(tmp_path,
                                                                             monkeypatch):
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    for name in ("engine.py", "plugin_wheel.py"):
        (tmp_path / "tests" / "engine" / name).write_text(
            (ROOT / "tests" / "engine" / name).read_text())
    (tmp_path / ".venv-engine" / "bin").mkdir(parents=True)
    (tmp_path / ".venv-engine" / "bin" / "python").touch()
    monkeypatch.setattr(demo, "_checkout_root", lambda: tmp_path)
    runner, why = demo._engine_runner()  # no .plugin-wheel stamp: never built from this source
    assert runner is None and "./scripts/bootstrap-engine.sh 0.11.0" in why
