"""What overlap mode's background save costs the training thread, and why (issue 22 item 4).

The demo's GPT (``small``) trains with one intra-op thread, so one of this machine's two cores
is free for the save's threads, as a GPU job leaves its host cores free. Contenders take turns
in blocks of ``--block`` iterations (the first not measured), rotated round by round; the
overhead is paired by round against "none", with a 95% bootstrap interval (the demo's method):

* ``none``: no checkpoint;
* ``overlap``: ``Checkpointer(mode="overlap")``, a checkpoint every iteration;
* ``overlap, 0.5 ms interval``: the same with the interpreter's switch interval lowered to
  0.5 ms while a save runs (``IOConfig(switch_interval_us=500)``, fastpersist.saving.gil);
* ``overlap nice 19``: the same with the save thread at niceness 19 (Linux, per thread; the
  writer threads it starts inherit it): does the background take the training thread's CPU?
* ``overlap direct from 64 KiB``: the same with ``IOConfig(zero_copy_min_bytes=64 KiB)``: live
  tensors from 64 KiB up are written straight from their memory (the default stages those
  under 1 MiB through the pool: a copy, a hash and a GIL round trip per piece);
* ``GIL G ms``: no checkpoint, but a thread that runs pure Python (holding the GIL, no I/O, no
  memory traffic) for ``--gil-ms`` of CPU time after every iteration: what holding the GIL that
  long costs training by itself;
* ``GIL G ms, 0.5 ms interval``: the same with the interpreter's switch interval at 0.5 ms;

and, with ``--profile``, the GIL-held time of the save thread per save, sampled by py-spy
(``py-spy record --gil``, 250 Hz) over a run of overlap saves, by function.

    python benchmarks/bench_overlap_cost.py [--rounds 30] [--gil-ms 14] [--profile]
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import torch

from _bench.models import ModelSpec, build, train_step
from _bench.savers import FastpersistSaver, make_saver
from fastpersist.config import IOConfig
from _bench.stats import overhead


def _save_threads() -> set[int]:
    """The native ids of this process's fastpersist save threads (one per Checkpointer, started
    by its first save)."""
    return {t.native_id for t in threading.enumerate() if t.name == "fastpersist-save" and t.native_id is not None}


class _GilHolder:
    """A thread that runs pure Python for ``seconds`` of its CPU time each time it is woken."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.go = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="gil-holder").start()

    def _run(self) -> None:
        while True:
            self.go.wait()
            self.go.clear()
            t0 = time.thread_time()
            x = 0
            while time.thread_time() - t0 < self.seconds:
                for i in range(200):
                    x += i


def measure(rounds: int, block: int, gil_ms: float, directory: str, only: list[str] | None = None
            ) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    holder = _GilHolder(gil_ms / 1e3)
    held = f"GIL {gil_ms:g} ms"
    names = ["none", "overlap", "overlap, 0.5 ms interval", "overlap nice 19", "overlap direct from 64 KiB",
             held, f"{held}, 0.5 ms interval"]
    configs = {"overlap, 0.5 ms interval": IOConfig(switch_interval_us=500),
               "overlap direct from 64 KiB": IOConfig(zero_copy_min_bytes=64 << 10)}
    if only:
        names = [n for n in names if n in only or (n.startswith("GIL") and "gil" in only)]
    runs = {}
    for n in names:
        model, opt, data = build(ModelSpec(batch=8), seed=0)
        kind = "overlap" if n.startswith("overlap") else "none"
        config = configs.get(n)
        runs[n] = (model, opt, data, make_saver(kind, os.path.join(directory, n.replace(" ", "_").replace(",", "")),
                                                opt, keep=1, config=config))
    it = 0
    others: set[int] | None = None  # the save threads that are not the nice contender's
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds + 1):  # round 0: warm-up
        for n in names[r % len(names):] + names[: r % len(names)]:
            model, opt, data, saver = runs[n]
            times = []
            if n == "overlap nice 19" and others is None:
                others = _save_threads()
            if n.startswith("GIL") and n.endswith("0.5 ms interval"):
                sys.setswitchinterval(0.0005)
            for _ in range(block):
                t0 = time.perf_counter()
                train_step(model, opt, data)
                it += 1
                saver.save(it, model, opt, data)
                if n.startswith("GIL"):
                    holder.go.set()
                times.append(time.perf_counter() - t0)
                if n == "overlap nice 19" and r == 0 and others is not None:
                    for tid in _save_threads() - others:  # its own, started by its first save
                        os.setpriority(os.PRIO_PROCESS, tid, 19)
            sys.setswitchinterval(0.005)
            if isinstance(saver, FastpersistSaver):
                saver.ck.wait()  # the next contender starts with no save in flight
            if r:
                out[n].append(statistics.median(times[1:]))
    for model, opt, data, saver in runs.values():
        saver.close()
    return out


def profile(saves: int) -> list[tuple[float, str]]:
    """GIL-held ms per save of the save thread, by fastpersist function (py-spy)."""
    raw = tempfile.mktemp(suffix=".txt")
    spy = os.path.join(os.path.dirname(sys.executable), "py-spy")  # installed beside python (the bench extra)
    subprocess.run([spy if os.path.exists(spy) else "py-spy", "record", "--gil", "--threads", "--rate", "250", "--format", "raw", "-o", raw, "--",
                    sys.executable, os.path.abspath(__file__), "--saves-only", str(saves)],
                   check=True, capture_output=True)
    by: collections.Counter[str] = collections.Counter()
    with open(raw) as f:
        for line in f:
            stack, n = line.rsplit(" ", 1)
            if "fastpersist-save" not in stack:
                continue
            frames = [x.split(" (")[0] for x in stack.split(";") if "fastpersist/" in x]
            by[frames[-1] if frames else "(outside fastpersist)"] += int(n)
    os.remove(raw)
    return [(n * 4.0 / saves, name) for name, n in by.most_common()]  # 250 Hz: 4 ms a sample


def _saves_only(n: int) -> None:
    torch.set_num_threads(1)
    model, opt, data = build(ModelSpec(batch=8), seed=0)
    d = tempfile.mkdtemp(prefix="fastpersist-overlapcost-", dir="/var/tmp")
    saver = make_saver("overlap", d, opt, keep=1)
    for i in range(n + 3):
        train_step(model, opt, data)
        saver.save(i, model, opt, data)
    saver.close()
    shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--block", type=int, default=6)
    p.add_argument("--gil-ms", type=float, default=14.0)
    p.add_argument("--dir", default="/var/tmp")
    p.add_argument("--profile", action="store_true", help="also profile the save thread's GIL time (py-spy)")
    p.add_argument("--only", default="", help="comma-separated contenders (none, overlap, 'overlap nice 19', "
                   "'overlap direct from 64 KiB'; 'gil' for the GIL holders); default: all")
    p.add_argument("--saves-only", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.saves_only is not None:
        _saves_only(a.saves_only)
        return
    d = tempfile.mkdtemp(prefix="fastpersist-overlapcost-", dir=a.dir)
    try:
        res = measure(a.rounds, a.block, a.gil_ms, d, [x.strip() for x in a.only.split(",") if x.strip()])
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"\nGPT small, 1 training thread, {a.rounds} rounds of {a.block} iterations, a save every iteration\n")
    print("| contender | ms per iteration median [min-max] | overhead vs none (95% interval) |")
    print("|---|---|---|")
    for n, xs in res.items():
        ov = "-" if n == "none" else str(overhead(res["none"], xs))
        print(f"| {n} | {statistics.median(xs) * 1e3:.1f} [{min(xs) * 1e3:.1f}-{max(xs) * 1e3:.1f}] | {ov} |")
    if a.profile:
        import fastpersist
        print(f"\n(fastpersist from {os.path.dirname(fastpersist.__file__)})")
        rows = profile(120)
        print(f"\nsave thread, GIL held per save: {sum(ms for ms, _ in rows):.1f} ms\n")
        print("| ms per save | fastpersist function (innermost) |")
        print("|---|---|")
        for ms, name in rows[:15]:
            print(f"| {ms:.2f} | {name} |")


if __name__ == "__main__":
    main()
