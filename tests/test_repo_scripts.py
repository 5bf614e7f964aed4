"""Shell entry points parse (bash -n), and the README's first commands are the real ones."""

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*ROOT.glob("examples/*.sh"), *ROOT.glob("scripts/*.sh"), ROOT / ".ci" / "run"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_shell_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_eval_script_rejects_unknown_layout():
    r = subprocess.run(["bash", str(ROOT / "examples" / "eval_gsm8k.sh")], capture_output=True,
                       text=True, env={"LAYOUT": "tp3", "PATH": "/usr/bin:/bin", "OUT": "/tmp"})
    assert r.returncode == 2 and "LAYOUT must be" in r.stderr


def test_readme_opens_with_demo_and_test_commands():
    text = (ROOT / "README.md").read_text()
    head = text[: text.index("## ")] if "## " in text else text
    assert "./scripts/bootstrap.sh && .venv/bin/vllm-fp4-moe matrix" in head
    assert "./scripts/bootstrap.sh --with-engine && .venv/bin/python -m pytest" in head
    ci = (ROOT / ".ci" / "run").read_text()
    assert "./scripts/bootstrap.sh --with-engine" in ci and ".venv/bin/python -m pytest" in ci
