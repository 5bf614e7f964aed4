#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Lint: ruff (`ruff check`, rules in pyproject.toml [tool.ruff.lint]) and codespell
# ([tool.codespell]) over the repository, mypy ([tool.mypy]) over the serving package, against the
# vLLM and torch of .venv. All come pinned from constraints/default.txt through the `test` extra
# (scripts/bootstrap.sh); LINT_PYTHON picks another interpreter that has them.
# Exit status: 0 when all are clean; otherwise non-zero (all still run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${LINT_PYTHON:-.venv/bin/python}
status=0
"$PYTHON" -m ruff check . || status=$?
# codespell's importable package is codespell_lib (there is no `codespell` module to -m).
"$PYTHON" -m codespell_lib || status=$?
"$PYTHON" -m mypy || status=$?
exit $status
