#!/usr/bin/env bash
# Sets up (.venv, see setup.sh) and runs the test suite (the README's test command) with the
# environment's Python. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=.venv/bin/python
# Types first (fast, and a type error is a bug the tests may not reach).
"$PY" -m mypy
exec "$PY" -m pytest -q "$@"
