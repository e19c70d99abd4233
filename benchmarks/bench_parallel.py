"""Write parallelism: how fastpersist's sharded checkpoints scale with roots and ranks.

Three parts, each printing a table (medians of several rounds, [min-max]):

1. scaling: every root is capped at CAP GB/s by a token bucket shared by all processes (a
   stand-in for N real SSDs; the roots live on tmpfs so the real medium is never the limit).
   Aggregate write bandwidth for k = 1, 2, 4, 8 roots in one process, and for 2 and 4 gloo
   ranks, against the ideal k x CAP.
2. ranks: real multi-process saves with 2 and 4 gloo ranks on the real disk and on tmpfs,
   every rank writing its share vs one rank writing everything, and the fixed coordination
   cost (a checkpoint of a few bytes).
3. load: a checkpoint written by 4 ranks, loaded at world size 1, vs fastpersist.load of the
   same state as a single file (cold page cache).
4. replicas: the cost of the replicated-state check (every rank hashes the state it holds,
   beside its writes) at 2 and 4 gloo ranks: saves with and without it, alternating in the
   same process group.

    python benchmarks/bench_parallel.py [--gib 0.25] [--rounds 3] [--parts scaling,ranks,load,replicas]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _bench.measure import drop_caches
from _bench.state import gpt_state, tensor_bytes
from _bench.stats import median_spread

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer
from fastpersist.storage.backend import FileBackend


class TokenBucketBackend(FileBackend):
    """Each root delivers at most ``cap`` bytes/s, shared by every thread and process.

    A write request reserves the next ``nbytes / cap`` seconds of its root's time (one shared
    value per root holds when the root is next free), sleeps until that reservation ends, then
    writes. The real medium (tmpfs) is much faster than the cap, so the cap is the limit.
    """

    def __init__(self, cap_bytes_per_s: float, clocks: list[Any]) -> None:
        self.cap = cap_bytes_per_s
        self.clocks = clocks

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        clock = self.clocks[root]
        with clock.get_lock():
            start = max(time.monotonic(), clock.value)
            clock.value = start + nbytes / self.cap
            until = clock.value
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)


def _clear(roots: list[str]) -> None:
    """Remove the checkpoints (not the roots: a Checkpointer holds a lock file there)."""
    for r in roots:
        for name in os.listdir(r) if os.path.isdir(r) else []:
            path = os.path.join(r, name)
            if name.startswith("step-"):
                shutil.rmtree(path, ignore_errors=True)
            elif name == "latest":
                os.unlink(path)


# ---------------------------------------------------------------------------------------------
# worker for multi-process runs


def _worker(rank: int, world: int, init: str, job: dict, results: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(1)  # gpt_state's optimizer moments come from the global generator: same on every rank
        state = gpt_state(job["gib"], seed=1) if job["gib"] > 0 else {"x": torch.ones(4)}
        backend = TokenBucketBackend(job["cap"], job["clocks"]) if job.get("cap") else None
        ck = Checkpointer(job["roots"], mode="sync", writers=job.get("writers", "all"), backend=backend)
        times = []
        for i in range(job["rounds"]):
            if rank == 0:
                _clear(job["roots"])
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(i, state).wait()
            dist.barrier()
            times.append(time.perf_counter() - t0)
        ck.close()
        if rank == 0:
            results.put(times)
    finally:
        dist.destroy_process_group()


def _replica_worker(rank: int, world: int, init: str, job: dict, results: Any) -> None:
    """Saves alternating with and without the replica check; rank 0 reports both lists."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        torch.manual_seed(1)  # replicated means the same bytes on every rank
        state = gpt_state(job["gib"], seed=1)
        roots = {c: [os.path.join(r, str(c)) for r in job["roots"]] for c in (True, False)}
        cks = {c: Checkpointer(roots[c], mode="sync", check_replicated=c) for c in (True, False)}
        times: dict[bool, list[float]] = {True: [], False: []}
        hashing: list[float] = []
        for i in range(job["rounds"]):
            for c in ((True, False) if i % 2 == 0 else (False, True)):
                if rank == 0:
                    _clear(roots[c])
                dist.barrier()
                t0 = time.perf_counter()
                m = cks[c].save(i, state).wait()
                dist.barrier()
                times[c].append(time.perf_counter() - t0)
                if c:
                    hashing.append(m.replica_check_s)
        for ck in cks.values():
            ck.close()
        if rank == 0:
            results.put((times, hashing))
    finally:
        dist.destroy_process_group()


def _multi(world: int, job: dict, worker: Any = _worker) -> Any:
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    init = f"file://{tempfile.mktemp(prefix='fastpersist-rdv-')}"
    mp.start_processes(worker, args=(world, init, job, results), nprocs=world, start_method="spawn")
    return results.get(timeout=5)


# ---------------------------------------------------------------------------------------------


def part_scaling(args: argparse.Namespace) -> None:
    cap = args.cap * 1e9
    ctx = multiprocessing.get_context("spawn")
    state = gpt_state(args.gib, seed=1)
    nbytes = tensor_bytes(state)
    base = tempfile.mkdtemp(prefix="fp-scale-", dir="/dev/shm")
    print(f"\n## Scaling over capped roots (cap {args.cap} GB/s per root, token bucket, tmpfs; "
          f"state {nbytes / 2**30:.2f} GiB)\n")
    print("| ranks | roots | ideal GB/s | measured GB/s (median [min-max]) | measured / ideal |")
    print("|---|---|---|---|---|")
    try:
        for ranks, ks in [(1, [1, 2, 4, 8]), (2, [1, 2, 4]), (4, [1, 2])]:
            for k in ks:
                roots = [os.path.join(base, f"root{j}") for j in range(k)]
                clocks = [ctx.Value("d", 0.0) for _ in range(k)]
                if ranks == 1:
                    ck = Checkpointer(roots, mode="sync", backend=TokenBucketBackend(cap, clocks))
                    times = []
                    for i in range(args.rounds):
                        _clear(roots)
                        t0 = time.perf_counter()
                        ck.save(i, state).wait()
                        times.append(time.perf_counter() - t0)
                    ck.close()
                else:
                    times = _multi(ranks, {"gib": args.gib, "roots": roots, "rounds": args.rounds,
                                           "cap": cap, "clocks": clocks})
                gbps = [nbytes / t / 1e9 for t in times]
                ideal = k * args.cap
                print(f"| {ranks} | {k} | {ideal:.2f} | {median_spread(gbps, 3)} | {statistics.median(gbps) / ideal:.2f} |",
                      flush=True)
                _clear(roots)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def part_ranks(args: argparse.Namespace) -> None:
    nbytes = tensor_bytes(gpt_state(args.gib, seed=1))
    print(f"\n## Multi-process saves (gloo; state {nbytes / 2**30:.2f} GiB, replicated on every rank; "
          "seconds per checkpoint, median [min-max])\n")
    print("| medium | ranks | all ranks write | one rank writes all | speed-up | coordination (tiny state) |")
    print("|---|---|---|---|---|---|")
    for medium, parent in [("disk (ext4, O_DIRECT)", args.dir), ("tmpfs", "/dev/shm")]:
        base = tempfile.mkdtemp(prefix="fp-ranks-", dir=parent)
        try:
            roots = [os.path.join(base, "root0")]
            for world in (2, 4):
                job = {"gib": args.gib, "roots": roots, "rounds": args.rounds}
                every = _multi(world, job)
                one = _multi(world, {**job, "writers": [0]})
                tiny = _multi(world, {**job, "gib": 0, "rounds": max(args.rounds, 5)})
                print(f"| {medium} | {world} | {median_spread(every, 3)} | {median_spread(one, 3)} | "
                      f"{statistics.median(one) / statistics.median(every):.2f}x | {median_spread([t * 1e3 for t in tiny], 3)} ms |",
                      flush=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def part_load(args: argparse.Namespace) -> None:
    state = gpt_state(args.gib, seed=1)
    nbytes = tensor_bytes(state)
    base = tempfile.mkdtemp(prefix="fp-load-", dir=args.dir)
    roots = [os.path.join(base, "root0")]
    single = os.path.join(base, "single.pt")
    try:
        _multi(4, {"gib": args.gib, "roots": roots, "rounds": 1})
        fp.save(state, single)
        del state
        ck = Checkpointer(roots)
        sharded: list[float] = []
        one_file: list[float] = []
        cold = True
        for _ in range(args.rounds):
            for fn, out in [(lambda: ck.load(0), sharded), (lambda: fp.load(single), one_file)]:
                cold = drop_caches() and cold
                t0 = time.perf_counter()
                obj = fn()
                out.append(nbytes / (time.perf_counter() - t0) / 1e9)
                del obj
        print(f"\n## Load at world size 1 ({'cold cache: drop_caches' if cold else 'page cache NOT dropped'}; "
              f"{nbytes / 2**30:.2f} GiB, GB/s median [min-max])\n")
        print("| checkpoint | GB/s | ratio |\n|---|---|---|")
        print(f"| single file (fastpersist.load) | {median_spread(one_file, 3)} | 1.00 |")
        print(f"| written by 4 ranks (Checkpointer.load) | {median_spread(sharded, 3)} | "
              f"{statistics.median(sharded) / statistics.median(one_file):.2f} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def part_replicas(args: argparse.Namespace) -> None:
    nbytes = tensor_bytes(gpt_state(args.gib, seed=1))
    print(f"\n## Cost of the replicated-state check (gloo; state {nbytes / 2**30:.2f} GiB on every rank; seconds "
          "per durable checkpoint, median [min-max]; with and without alternating)\n")
    print("| medium | ranks | with check | without | throughput with / without | hashing per rank (beside the writes) |")
    print("|---|---|---|---|---|---|")
    for medium, parent in [("disk (ext4, O_DIRECT)", args.dir), ("tmpfs", "/dev/shm")]:
        base = tempfile.mkdtemp(prefix="fp-replicas-", dir=parent)
        try:
            for world in (2, 4):
                times, hashing = _multi(world, {"gib": args.gib, "roots": [os.path.join(base, "root0")],
                                                "rounds": args.rounds}, _replica_worker)
                ratio = statistics.median(times[False]) / statistics.median(times[True])
                print(f"| {medium} | {world} | {median_spread(times[True], 3)} | {median_spread(times[False], 3)} | {ratio:.3f} | "
                      f"{median_spread([h * 1e3 for h in hashing], 3)} ms |", flush=True)
        finally:
            shutil.rmtree(base, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=0.25, help="state size in GiB")
    p.add_argument("--cap", type=float, default=0.1, help="per-root cap for the scaling part, GB/s")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the real disk")
    p.add_argument("--parts", default="scaling,ranks,load")
    args = p.parse_args(argv)
    cpu = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"# fastpersist parallel benchmark: {cpu} cores, torch {torch.__version__}, python {sys.version.split()[0]}")
    parts = {"scaling": part_scaling, "ranks": part_ranks, "load": part_load, "replicas": part_replicas}
    for name in args.parts.split(","):
        parts[name](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
