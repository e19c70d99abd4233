#!/usr/bin/env bash
# Sets up (.venv, see setup.sh) and runs the main job: `fastpersist demo`, per-iteration
# checkpointing of a small GPT and a small mixture of experts on the CPU (table of iteration time
# per checkpoint mode), then a training run killed with SIGKILL mid-write and resumed exactly.
# A few minutes. Extra arguments go to `fastpersist demo` (e.g. --rounds 3 --threads 2).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m fastpersist demo "$@"
