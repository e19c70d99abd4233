#!/usr/bin/env bash
# Sets up and runs the test suite (the README's test command). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Types first (fast, and a type error is a bug the tests may not reach).
${PYTHON:-python3} -m mypy
exec ${PYTHON:-python3} -m pytest -q "$@"
