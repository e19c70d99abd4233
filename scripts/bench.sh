#!/usr/bin/env bash
# Sets up and runs the main job: the single-file benchmark at its default size (1 GiB state,
# 3 alternating rounds). Extra arguments go to `fastpersist bench` (e.g. --sizes 2,4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec ${PYTHON:-python3} -m fastpersist bench "$@"
