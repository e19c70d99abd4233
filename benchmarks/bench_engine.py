"""What a checkpoint every iteration costs training, by save engine (issue 36).

The demo's GPT and MoE (``ModelSpec(batch=8)``) train with one intra-op thread, a checkpoint
every iteration, on this machine's CPU: one core trains, the other is free for the save, as a
GPU job leaves its host cores free. Contenders take turns in blocks of ``--block`` iterations
(the first of each block not measured), rotated round by round, round 0 a warm-up; the overhead
is paired by round against ``none``, with a 95% bootstrap interval (the demo's method):

* ``none``: no checkpoint;
* ``bytes``: no checkpoint, but another process (no torch) writes as many bytes as the state
  holds, O_DIRECT and fsync, once per iteration: what the write itself costs training on this
  machine, the floor of any saver;
* ``overlap+process``, ``snapshot+process``: ``Checkpointer(engine="process")``: save() hands
  the save process a small message (overlap: the optimizer's tensors are in shared memory
  already; snapshot: save() copies the state into the shared arena first); everything else runs
  there; ``overlap+process nice 10``: the save process at niceness 10
  (``IOConfig.save_process_nice``);
* ``overlap``, ``snapshot``: the in-process thread engine in its two background modes;
* ``dcp``, ``dcp-process``: ``torch.distributed.checkpoint.async_save`` with the thread and the
  process executor, ``FileSystemWriter(sync_files=True)``, one save in flight;
* ``torch.save``: ``torch.save`` + fsync, in the training thread.

``blocked ms`` is the median time training waited per save (inside save(), plus guarded
optimizer steps that waited). With ``--memory``, each fastpersist contender also runs alone in
a fresh process for ``--block`` iterations and the table gives the proportional set size (PSS:
shared pages counted once) of the training process plus its save process at the end.

    python benchmarks/bench_engine.py [--rounds 12] [--block 6] [--models gpt,moe] [--only ...] [--memory]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from _bench.models import ModelSpec, build, train_step
from _bench.savers import DCPAsyncSaver, FastpersistSaver, make_saver
from _bench.stats import overhead
from fastpersist.config import IOConfig

CONTENDERS = ["none", "bytes", "overlap+process", "overlap+process nice 10", "snapshot+process", "overlap", "snapshot",
              "dcp", "dcp-process", "torch.save"]
MODELS = {"gpt": 0, "moe": 4}  # experts per layer


SIZES = {"small": ModelSpec(batch=8), "tiny": ModelSpec(vocab=128, d=32, layers=1, heads=2, seq=16, batch=2)}
_size = "small"


def _spec(model: str) -> ModelSpec:
    return dataclasses.replace(SIZES[_size], name=model.upper(), experts=MODELS[model])


def measure(model: str, contenders: list[str], rounds: int, block: int, directory: str
            ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per contender: the median seconds per iteration of each round, and blocked seconds per save."""
    torch.set_num_threads(1)
    runs = {}
    for n in contenders:
        m, opt, data = build(_spec(model), seed=0)
        own = os.path.join(directory, model, n.replace("+", "-").replace(".", "").replace(" ", "-"))
        os.makedirs(own, exist_ok=True)
        kind, _, nice = n.partition(" nice ")
        config = IOConfig(save_process_nice=int(nice)) if nice else None
        runs[n] = (m, opt, data, make_saver(kind, own, opt, keep=1, config=config))
    times: dict[str, list[float]] = {n: [] for n in contenders}
    blocked: dict[str, list[float]] = {n: [] for n in contenders}
    it = 0
    for r in range(rounds + 1):
        for n in contenders[r % len(contenders):] + contenders[: r % len(contenders)]:
            m, opt, data, saver = runs[n]
            per_iter = []
            for _ in range(block):
                t0 = time.perf_counter()
                train_step(m, opt, data)
                it += 1
                waited = saver.save(it, m, opt, data)
                per_iter.append(time.perf_counter() - t0)
                if r and n != "none":
                    blocked[n].append(waited)
            if isinstance(saver, FastpersistSaver):
                saver.ck.wait()  # the next contender starts with no save in flight
            elif isinstance(saver, DCPAsyncSaver):
                saver.close()
            if r:
                times[n].append(statistics.median(per_iter[1:]))
    for n, (_, _, _, saver) in runs.items():
        if isinstance(saver, FastpersistSaver):
            guarded = saver.blocked()  # inside save() plus guarded optimizer steps that waited
            if guarded:
                blocked[n] = guarded[-len(blocked[n]):] if blocked[n] else guarded
        saver.close()
    return times, blocked


def _pss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1])
    return 0


def _memory_one(model: str, contender: str, iters: int, directory: str) -> dict[str, float]:
    torch.set_num_threads(1)
    m, opt, data = build(_spec(model), seed=0)
    saver = make_saver(contender, directory, opt, keep=1)
    for it in range(iters):
        train_step(m, opt, data)
        saver.save(it, m, opt, data)
    pids = [os.getpid()]
    if isinstance(saver, FastpersistSaver):
        saver.ck.wait()
        remote = getattr(saver.ck, "_remote", None)
        if remote is not None:
            pids.append(remote.pid)
    pss = sum(_pss_kib(p) for p in pids)
    saver.close()
    return {"pss_mib": pss / 1024}


def memory(model: str, contenders: list[str], iters: int, directory: str) -> dict[str, float]:
    out = {}
    for n in contenders:
        d = tempfile.mkdtemp(prefix="mem-", dir=directory)
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-one", n, "--models", model,
                              "--block", str(iters), "--dir", d, "--size", _size], check=True, capture_output=True,
                             text=True)
        out[n] = json.loads(run.stdout.strip().splitlines()[-1])["pss_mib"]
        shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--block", type=int, default=6)
    p.add_argument("--models", default="gpt,moe")
    p.add_argument("--only", default="", help="comma-separated contenders (none is always measured)")
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--memory", action="store_true", help="also the PSS of training + save process (fastpersist)")
    p.add_argument("--memory-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="the demo's size (tiny: the tests')")
    a = p.parse_args()
    global _size
    _size = a.size
    if a.memory_one:
        print(json.dumps(_memory_one(a.models, a.memory_one, a.block, a.dir)))
        return
    contenders = CONTENDERS if not a.only else ["none"] + [c for c in CONTENDERS if c in a.only.split(",") and c != "none"]
    d = tempfile.mkdtemp(prefix="fastpersist-engine-", dir=a.dir)
    try:
        for model in a.models.split(","):
            times, blocked = measure(model, contenders, a.rounds, a.block, d)
            mem = memory(model, [c for c in contenders if c in ("overlap+process", "snapshot+process", "overlap", "snapshot")],
                         a.block * 4, d) if a.memory else {}
            print(f"\n{model.upper()} ({a.size} size), 1 training thread, a checkpoint every iteration, "
                  f"{a.rounds} rounds of {a.block} iterations\n")
            print("| contender | ms per iteration median [min-max] | overhead vs none [95% interval] | blocked ms per save"
                  + (" | PSS training + save process MiB" if mem else "") + " |")
            print("|---|---|---|---|" + ("---|" if mem else ""))
            for n in contenders:
                xs = times[n]
                o = overhead(times["none"], xs)
                ov = "-" if n == "none" else f"{o.estimate * 100:+.1f}% [{o.low * 100:+.1f}, {o.high * 100:+.1f}]"
                b = f"{statistics.median(blocked[n]) * 1e3:.1f}" if blocked[n] else "-"
                row = f"| {n} | {statistics.median(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}] | {ov} | {b}"
                if mem:
                    row += f" | {mem[n]:.0f}" if n in mem else " | -"
                print(row + " |", flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
