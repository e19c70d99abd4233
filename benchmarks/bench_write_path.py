"""The write path against the device: how close a checkpoint's write gets to raw O_DIRECT.

Each measurement runs in a fresh process on the same state in the same directory, memory warm
(the state is built and touched before timing). The Checkpointer and ``fastpersist.save``
contenders first save once untimed (the steady state of per-iteration checkpointing: the
snapshot arena and the staging buffers exist); with ``--cold`` they do not: the timed save is
the process's first (what a job's first checkpoint pays: the staging pool, the snapshot arena and
the writer threads are made during it). Before the timed write the previous files are
gone and the disk is synced and left idle for ``--settle`` seconds. Contenders alternate and
rotate round by round, so the disk's drift hits all alike; each ratio is per round (raw's time
over the contender's, same round), then median [min-max] over rounds.

* ``raw``: O_DIRECT 64 MiB requests from one aligned buffer holding the same bytes, then fsync:
  what the device takes through the same system calls with no checkpoint logic;
* ``sync``: ``Checkpointer(mode="sync")``: save() until committed, written from live memory;
* ``snapshot``: ``Checkpointer()`` (the default mode and settings): save() then wait for the
  commit; nothing is in flight, so ``snapshot_pipeline="auto"`` copies first, then writes;
* ``pipelined``: the same with ``snapshot_pipeline="on"``: the copy into the snapshot arena
  overlaps the writes (fastpersist.io.fills);
* ``process``: ``Checkpointer(engine="process")``: the same save, written by the save process
  from the shared arena (save() copies the state into it, the save process does the rest);
* ``fio``: fio's O_DIRECT write of the same bytes (libaio, 64 MiB requests, 4 in flight, then
  fsync; its own timing): the device's limit with requests in flight (``raw`` has one);
* ``single``: ``fastpersist.save`` of the same state to one torch-loadable file (the default:
  from the tensors while the staging pool is cold, staged once it is warm);
  ``single-staged`` and ``single-zc``: the same, always staged / always from the tensors;
* ``layout``: torch's pickle of the state and the archive's layout alone, what ``fastpersist.save``
  does before its first byte can be written (its row's seconds are the figure; with ``--cold`` the
  process's first, as a first save pays it);
* ``deepspeed``: DeepSpeed's FastPersist writer, ``torch.save`` into ``deepspeed.io.FastFileWriter``
  set up as DeepSpeed's checkpoint engine sets it up (benchmarks/_bench/deepspeed_writer.py;
  measured where DeepSpeed is installed: ``FASTPERSIST_SETUP_DEEPSPEED=1 bash scripts/setup.sh``);
* with ``--cold``: ``sync+reserve``, ``snapshot+reserve`` and ``pipelined+reserve``, the same
  with ``Checkpointer.reserve(state)`` called right after the Checkpointer is made, before the
  settle time (what a job that reserves its memory during its first iterations pays);
* with ``--before SRC``: ``snapshot@before`` and ``single@before``, those contenders run from another source
  tree (e.g. a checkout of a commit before a change).

``--loop`` measures the pipeline where it matters, in a training loop that saves every
iteration: ``--iters`` iterations of ``--compute`` seconds each (a sleep: the accelerator
computes, the host's cores are free), one snapshot save per iteration, for each of
``snapshot_pipeline`` off / on / auto, rotated round by round. A short compute (saves come
faster than the disk takes them) is the regime where the commit's time holds training back; a
long one is the regime where only the time blocked in save() does. The table gives the seconds
per iteration (median over rounds of each round's mean) and the time blocked per save.

    python benchmarks/bench_write_path.py [--gib 1] [--rounds 5] [--dir /var/tmp] [--before /path/src] [--cold]
    python benchmarks/bench_write_path.py --loop [--gib 1] [--compute 0.05] [--iters 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "src")
GB = 1e9


def _tensors(obj: object) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _one(contender: str, gib: float, directory: str, settle: float, compute: float, iters: int,
         cold: bool = False) -> dict[str, float]:
    """Run one contender in this process; its seconds and payload bytes."""
    import torch

    from _bench.state import gpt_state, tensor_bytes

    torch.set_num_threads(2)
    state = gpt_state(gib, seed=0)
    nbytes = tensor_bytes(state)
    target = os.path.join(directory, "target")
    shutil.rmtree(target, ignore_errors=True)
    if contender == "raw":
        from fastpersist.io.buffers import aligned_empty, memory_view
        from fastpersist.io.files import O_DIRECT, pwrite_all

        request = 64 << 20
        total = -(-nbytes // request) * request
        buf = aligned_empty(total, pin=False)
        pos = 0
        for t in _tensors(state):
            b = t.reshape(-1).view(torch.uint8)
            buf[pos : pos + b.numel()].copy_(b)
            pos += b.numel()
        os.makedirs(target)
        path = os.path.join(target, "raw.bin")
        os.sync()
        time.sleep(settle)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | O_DIRECT, 0o644)
        try:
            for off in range(0, total, request):
                pwrite_all(fd, memory_view(buf.data_ptr() + off, request), off)
            os.fsync(fd)
        finally:
            os.close(fd)
        return {"s": time.perf_counter() - t0, "bytes": nbytes}
    if contender == "fio":
        from _bench.measure import _fio

        os.makedirs(target)
        size = -(-nbytes // (64 << 20)) * (64 << 20)
        os.sync()
        time.sleep(settle)
        sample, _ = _fio(os.path.join(target, "fio.bin"), "write", size)
        return {"s": sample.seconds * nbytes / size, "bytes": nbytes}
    if contender == "deepspeed":
        from _bench import deepspeed_writer

        deepspeed_writer.silence()
        writer = deepspeed_writer.Writer()  # the engine's start: its I/O buffer is made and zeroed
        os.makedirs(target)
        if not cold:
            writer.save(state, os.path.join(target, "warm.pt"))
            os.remove(os.path.join(target, "warm.pt"))
        os.sync()
        time.sleep(settle)
        t0 = time.perf_counter()
        writer.save(state, os.path.join(target, "ck.pt"))
        return {"s": time.perf_counter() - t0, "bytes": nbytes}
    import fastpersist as fp

    if contender == "layout":  # what fastpersist.save does before its first byte can be written
        from fastpersist.format import skeleton, torchzip

        if not cold:
            torchzip.layout(state, phase_from=1 << 20)
        t0 = time.perf_counter()
        with skeleton.collector_paused():  # as fastpersist.save runs it
            torchzip.layout(state, phase_from=1 << 20)
        return {"s": time.perf_counter() - t0, "bytes": nbytes}
    if contender.startswith("single"):
        config = {"single": None, "single-staged": fp.IOConfig(single_file_zero_copy=False),
                  "single-zc": fp.IOConfig(single_file_zero_copy=True)}[contender]
        os.makedirs(target)
        if not cold:
            fp.save(state, os.path.join(target, "warm.pt"), config=config)  # steady state: staging buffers exist
            os.remove(os.path.join(target, "warm.pt"))
        os.sync()
        time.sleep(settle)
        t0 = time.perf_counter()
        fp.save(state, os.path.join(target, "ck.pt"), config=config)
        return {"s": time.perf_counter() - t0, "bytes": nbytes}
    if contender.startswith("loop-"):
        return _loop(fp, state, target, contender[len("loop-"):], compute, iters, settle)
    reserve = contender.endswith("+reserve")
    contender = contender.removesuffix("+reserve")
    mode = "sync" if contender == "sync" else "snapshot"
    config = fp.IOConfig(snapshot_pipeline="on") if contender == "pipelined" else None  # else the defaults
    engine = "process" if contender == "process" else "thread"
    ck = fp.Checkpointer(target, mode=mode, keep=2, config=config, engine=engine)
    if not cold:
        ck.save(0, state).result()  # steady state: the arena and staging buffers exist, as in training
    elif reserve:
        ck.reserve(state)  # in the background, during the settle time (a job's first iterations)
    os.sync()
    time.sleep(settle)
    t0 = time.perf_counter()
    h = ck.save(1, state)
    blocked = time.perf_counter() - t0
    h.result()
    s = time.perf_counter() - t0
    ck.close()
    return {"s": s, "bytes": nbytes, "blocked": blocked}


def _loop(fp, state: dict, target: str, pipeline: str, compute: float, iters: int, settle: float) -> dict[str, float]:
    """A training loop that saves every iteration; seconds per iteration and blocked per save."""
    ck = fp.Checkpointer(target, keep=2, config=fp.IOConfig(snapshot_pipeline=pipeline))
    ck.save(0, state).result()  # steady state: the arena and staging buffers exist
    os.sync()
    time.sleep(settle)
    handles = []
    t0 = time.perf_counter()
    for i in range(1, iters + 1):
        time.sleep(compute)  # forward and backward on the accelerator
        handles.append(ck.save(i, state))
    handles[-1].result()
    s = time.perf_counter() - t0
    ck.close()
    return {"iter_s": s / iters, "blocked": statistics.median(h.metrics.blocked_s for h in handles),
            "pipelined": sum(h.metrics.pipelined for h in handles) / iters}


def _run(contender: str, gib: float, directory: str, src: str, settle: float, compute: float = 0.0,
         iters: int = 0, cold: bool = False) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, HERE]), OMP_NUM_THREADS="2")
    name = contender.split("@")[0]
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", name, "--gib", str(gib),
                          "--dir", directory, "--settle", str(settle), "--compute", str(compute), "--iters", str(iters)]
                         + (["--cold"] if cold else []),
                         env=env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _spread(xs: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(xs):{fmt}} [{min(xs):{fmt}}-{max(xs):{fmt}}]"


def _main_loop(a: argparse.Namespace, directory: str) -> None:
    contenders = ["loop-off", "loop-on", "loop-auto"]
    results: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
    for r in range(a.rounds):
        for c in contenders[r % 3:] + contenders[: r % 3]:
            results[c].append(_run(c, a.gib, directory, SRC, a.settle, a.compute, a.iters))
    print(f"\n{a.gib} GiB GPT-like state, a save every iteration of {a.compute} s compute, {a.iters} iterations, "
          f"{a.rounds} rounds, {a.dir}\n")
    print("| snapshot_pipeline | s per iteration | vs off (per round) | blocked per save s | saves pipelined |")
    print("|---|---|---|---|---|")
    for c in contenders:
        it = [x["iter_s"] for x in results[c]]
        ratio = [x["iter_s"] / results["loop-off"][i]["iter_s"] for i, x in enumerate(results[c])]
        print(f"| {c[5:]} | {_spread(it, '.3f')} | {_spread(ratio)} | {_spread([x['blocked'] for x in results[c]], '.3f')} "
              f"| {statistics.median(x['pipelined'] for x in results[c]):.0%} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk under test")
    p.add_argument("--settle", type=float, default=2.0, help="idle seconds before each measurement")
    p.add_argument("--before", default=None, help="another source tree for snapshot@before and single@before contenders")
    p.add_argument("--loop", action="store_true", help="the training-loop scenario (see above)")
    p.add_argument("--compute", type=float, default=0.05, help="--loop: seconds of compute per iteration")
    p.add_argument("--iters", type=int, default=8, help="--loop: iterations (one save each)")
    p.add_argument("--cold", action="store_true", help="time each process's first save (no untimed save before)")
    p.add_argument("--only", default="", help="comma-separated contenders (raw is always measured)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(_one(a.one, a.gib, a.dir, a.settle, a.compute, a.iters, a.cold)))
        return
    directory = tempfile.mkdtemp(prefix="fastpersist-writepath-", dir=a.dir)
    if a.loop:
        try:
            _main_loop(a, directory)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    contenders = (["raw", "fio", "sync", "snapshot", "pipelined", "process", "single", "single-staged", "single-zc", "layout",
                   "deepspeed"]
                  + (["sync+reserve", "snapshot+reserve", "pipelined+reserve"] if a.cold else [])
                  + (["snapshot@before", "single@before"] if a.before else []))
    if a.only:
        contenders = ["raw"] + [c for c in contenders if c != "raw" and c in a.only.split(",")]
    skipped = []
    if "fio" in contenders and not shutil.which("fio"):
        contenders.remove("fio")
        skipped.append("fio (not installed)")
    if "deepspeed" in contenders and importlib.util.find_spec("deepspeed") is None:
        contenders.remove("deepspeed")
        skipped.append("deepspeed (not installed: FASTPERSIST_SETUP_DEEPSPEED=1 bash scripts/setup.sh)")
    results: dict[str, list[dict[str, float]]] = {c: [] for c in contenders}
    try:
        for r in range(a.rounds):
            order = contenders[r % len(contenders):] + contenders[: r % len(contenders)]  # rotated
            for c in order:
                results[c].append(_run(c, a.gib, directory, a.before if c.endswith("@before") else SRC, a.settle,
                                       cold=a.cold))
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    memory = "cold: each process's first save" if a.cold else "warm memory"
    print(f"\n{a.gib} GiB GPT-like state, {a.rounds} rounds, {memory}, {a.dir}"
          + (f"; not measured: {', '.join(skipped)}" if skipped else "") + "\n")
    print("| contender | s | GB/s median [min-max] | of raw (per round) | blocked s |")
    print("|---|---|---|---|---|")
    for c in contenders:
        secs = [x["s"] for x in results[c]]
        gbs = [x["bytes"] / x["s"] / GB for x in results[c]]
        ratio = [results["raw"][i]["s"] / x["s"] for i, x in enumerate(results[c])]
        blocked = [x["blocked"] for x in results[c] if "blocked" in x]
        if c == "layout":  # not a write: only its seconds mean something
            print(f"| {c} | {_spread(secs, '.3f')} | - | - | - |")
            continue
        print(f"| {c} | {_spread(secs, '.3f')} | {_spread(gbs)} | {_spread(ratio)} | "
              f"{_spread(blocked) if blocked else '-'} |")


if __name__ == "__main__":
    main()
