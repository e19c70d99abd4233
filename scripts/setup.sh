#!/usr/bin/env bash
# Installs fastpersist and what its tests, benchmarks and demo need into a project-local virtual
# environment, .venv, and nothing else: the packages of the Python that runs this script (and of
# any environment the user has) are never installed, upgraded or replaced.
#
# torch is pinned first (the CPU wheel of torch 2.13.0: a bare "torch" requirement would pull a
# multi-GB CUDA build), and a constraint file holds it at that version while the extras install.
# A second run is quick: when .venv holds a stamp matching pyproject.toml and this script, nothing
# is reinstalled. FASTPERSIST_SETUP_FORCE=1 reinstalls anyway; PYTHON chooses the interpreter
# that creates the environment (python3 by default). FASTPERSIST_SETUP_DEEPSPEED=1 also installs
# DeepSpeed 0.19.8 and ninja (and Debian's libaio-dev, as root), for the write-path benchmark's
# DeepSpeed contender; its ops build on first use (minutes, then cached).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv
VPY=$VENV/bin/python
STAMP=$VENV/.fastpersist-setup
WANT=$( (cat pyproject.toml scripts/setup.sh; echo "deepspeed=${FASTPERSIST_SETUP_DEEPSPEED:-0}") | sha256sum | cut -d' ' -f1)

if [ -x "$VPY" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ] \
        && [ "${FASTPERSIST_SETUP_FORCE:-0}" != 1 ]; then
    exit 0  # complete and current
fi

if [ ! -x "$VPY" ]; then
    ${PYTHON:-python3} -m venv "$VENV"
fi
rm -f "$STAMP"   # written again only when every step below has succeeded
PIP=("$VPY" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" "torch==2.13.0"
# Lightning, transformers and accelerate (integrations), matplotlib (plot), pytest and mypy
# (test), psutil (bench); the constraint keeps pip from replacing the pinned torch.
CONSTRAINT=$(mktemp)
trap 'rm -f "$CONSTRAINT"' EXIT
"$VPY" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$CONSTRAINT"
"${PIP[@]}" -c "$CONSTRAINT" -e ".[test,bench,integrations,plot]"
# torchtitan (its integration and test): without its declared dependencies (datasets, wandb,
# tensorboard, tokenizers...: its data and logging, which the checkpoint manager never imports;
# the datasets pin would also downgrade fsspec), plus the two its config and checkpoint code import.
"${PIP[@]}" -c "$CONSTRAINT" "tyro==1.0.17" "spmd_types==0.2.3"
"${PIP[@]}" -c "$CONSTRAINT" --no-deps "torchtitan==0.3.0"
# fio measures the device's own limit in the benchmark (optional: a raw O_DIRECT probe stands in).
if ! command -v fio >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fio) >/dev/null 2>&1 \
        || echo "setup: fio could not be installed; the benchmark will use its raw O_DIRECT probe" >&2
fi
if [ "${FASTPERSIST_SETUP_DEEPSPEED:-0}" = 1 ]; then
    if ! dpkg -s libaio-dev >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libaio-dev) >/dev/null 2>&1 \
            || echo "setup: libaio-dev could not be installed; DeepSpeed's aio op will not build" >&2
    fi
    "${PIP[@]}" -c "$CONSTRAINT" "deepspeed==0.19.8" ninja
fi
echo "$WANT" > "$STAMP"
