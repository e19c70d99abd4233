"""Loading a sharded Checkpointer checkpoint at other world sizes and placements.

A DTensor state (Shard(0) over a 1-D CPU mesh, --gib GiB in all) is saved once by 4 gloo ranks
over 2 roots with ``Checkpointer.save``. Then, round after round (the page cache dropped
before every load, the order rotated), it is loaded with ``fastpersist.open(roots).load(into=...)``:

- ``same layout``: 4 ranks, Shard(0), each rank reading exactly what it wrote;
- ``Shard(0) at 3`` / ``at 2``: the rows split over 3 or 2 ranks (FSDP2 resumed at another size);
- ``Shard(1) at 4``: the columns split over 4 ranks (every rank needs a slice of every row);
- ``whole, 1 process``: no process group, the whole tensors.

Reported: GB/s (the state's bytes over the wall time of the slowest rank), median [min-max],
and each one's ratio to the same-layout load.

    python benchmarks/bench_reshard.py [--gib 1] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp

from _bench.measure import device_summary, drop_caches

SAVE_WORLD = 4
COLS = 1024


def _rows(gib: float) -> list[int]:
    total = int(gib * (1 << 30)) // 4 // COLS
    rows = [total // 2, total // 4, total // 8, total // 8]
    return [r - r % 96 for r in rows]  # divisible by 2, 3 and 4 ranks x 8


def _state(rows: list[int], world: int, dim: int, fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": distribute_tensor(torch.randn(n, COLS, generator=g) if fill else torch.zeros(n, COLS),
                                                  mesh, [Shard(dim)])
            for i, n in enumerate(rows)}


def _ranks(rank: int, world: int, base: str, job: str, rows: list[int], dim: int, out: Any) -> None:
    import torch.distributed as dist

    import fastpersist as fp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{base}/rdv-{job}", rank=rank, world_size=world)
    roots = [os.path.join(base, "root0"), os.path.join(base, "root1")]
    if job == "save":
        with fp.Checkpointer(roots, mode="sync") as ck:
            ck.save(0, _state(rows, world, 0, True))
    else:
        into = _state(rows, world, dim, False)
        if rank == 0:
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        fp.open(roots).load(0, into=into)
        dist.barrier()
        if rank == 0:
            out.put(time.perf_counter() - t0)
    dist.destroy_process_group()


def _whole(base: str, out: Any) -> None:
    import fastpersist as fp

    drop_caches()
    t0 = time.perf_counter()
    fp.open([os.path.join(base, "root0"), os.path.join(base, "root1")]).load(0)
    out.put(time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="fp-bench-reshard-", dir=a.dir)
    device = device_summary(base, int(a.gib * (1 << 30)))
    rows = _rows(a.gib)
    nbytes = sum(rows) * COLS * 4
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    cases = {"same layout (Shard(0) at 4)": (4, 0), "Shard(0) at 3": (3, 0), "Shard(0) at 2": (2, 0),
             "Shard(1) at 4": (4, 1), "whole, 1 process": (1, -1)}
    times: dict[str, list[float]] = {name: [] for name in cases}
    try:
        mp.start_processes(_ranks, args=(SAVE_WORLD, base, "save", rows, 0, q), nprocs=SAVE_WORLD,
                           start_method="spawn")
        names = list(cases)
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                world, dim = cases[name]
                if dim < 0:
                    proc = ctx.Process(target=_whole, args=(base, q))
                    proc.start()
                    proc.join()
                else:
                    mp.start_processes(_ranks, args=(world, base, f"{r}-{world}-{dim}", rows, dim, q), nprocs=world,
                                       start_method="spawn")
                times[name].append(q.get(timeout=60))
                print(f"round {r + 1}: {name} {nbytes / 1e9 / times[name][-1]:.2f} GB/s", file=sys.stderr)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = nbytes / 1e9
    same = statistics.median(times[names[0]])
    print(f"# Reshard load: a {nbytes / 2**30:.2f} GiB Shard(0) DTensor state saved by {SAVE_WORLD} ranks over 2 "
          f"roots; {os.cpu_count()} cores; torch {torch.__version__}; {a.rounds} rounds, median [min-max]; "
          f"{device}\n")
    print("| load | GB/s | vs same layout |")
    print("|---|---|---|")
    for name, ts in times.items():
        rates = [gb / t for t in ts]
        print(f"| {name} | {statistics.median(rates):.2f} [{min(rates):.2f}-{max(rates):.2f}] | "
              f"{same / statistics.median(ts):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
