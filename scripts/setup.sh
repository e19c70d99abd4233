#!/usr/bin/env bash
# Installs fastpersist and what its tests and benchmarks need, on a fresh machine.
# torch is pinned first: this machine keeps the CPU wheel of torch 2.13.0 on disk, while a bare
# "torch" requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
$PY -m pip install -q --disable-pip-version-check "torch==2.13.0"
# The integrations extra (Lightning, transformers, accelerate) for the integration tests; the
# constraint keeps pip from replacing the pinned torch.
CONSTRAINT=$(mktemp)
$PY -c "import torch; print('torch==' + torch.__version__)" > "$CONSTRAINT"
$PY -m pip install -q --disable-pip-version-check -c "$CONSTRAINT" -e ".[test,bench,integrations]"
rm -f "$CONSTRAINT"
# fio measures the device's own limit in the benchmark (optional: a raw O_DIRECT probe stands in).
if ! command -v fio >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio) >/dev/null 2>&1 \
        || echo "setup: fio could not be installed; the benchmark will use its raw O_DIRECT probe"
fi
