#!/usr/bin/env bash
# Sets up (.venv, see setup.sh) and runs the single-file benchmark at its default size (1 GiB
# state, 4 rounds). Extra arguments go to `fastpersist bench` (e.g. --sizes 2,4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m fastpersist bench "$@"
