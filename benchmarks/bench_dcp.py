"""Sharded state through torch.distributed.checkpoint: fastpersist's storage layer vs DCP's own.

--world gloo ranks (4) on one node, 2 roots, a DTensor state (Shard(0) over a 1-D CPU mesh) of
--gib GiB in all. Contenders run alternately in the same process group, round after round:

- ``fastpersist.dcp``: ``dcp.save`` with ``fastpersist.dcp.Writer`` (and ``dcp.async_save``);
- ``FileSystemWriter tN``: ``dcp.save`` with DCP's writer at thread_count N (and async_save);
- ``Checkpointer``: ``Checkpointer.save(step, state)`` with the DTensors in ``state`` (each rank
  writes its own shards over both roots), in sync mode and in snapshot mode (save() returns once
  the shards are copied; the write runs in the background); loaded with ``load(into=...)``.

Reported per contender: durable save GB/s (all ranks' bytes over the wall time of the call,
barrier included), time the training thread is blocked (the call for sync saves; until
async_save returns for async ones), CPU seconds per GB (all ranks), and load GB/s: same layout,
and resharded (Shard(1) instead of Shard(0)), with the page cache dropped before each load.

With ``--only`` (comma-separated names) only those contenders run; ``--no-loads`` skips the loads.
The header gives the device's O_DIRECT write (fio when installed) measured at the start; "of the
device" is each save's GB/s over it: the ranks of one node share its disk.

    python benchmarks/bench_dcp.py [--gib 1] [--rounds 3] [--world 4] [--dir /tmp] [--only NAMES] [--no-loads]
"""

from __future__ import annotations

import argparse
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
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

from _bench.measure import device_summary, drop_caches
from _bench.stats import median_spread

WORLD = 4  # default ranks


def _state(gib: float, placement: Any, mesh: Any, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    total = int(gib * (1 << 30)) // 4  # float32 elements
    cols = 1024
    rows_total = total // cols
    sizes = [rows_total // 2, rows_total // 4, rows_total // 8]
    sizes.append(rows_total - sum(sizes))
    g = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}
    for i, rows in enumerate(sizes):
        rows -= rows % (world * 8)
        full = torch.randn(rows, cols, generator=g)
        out[f"layer{i}.weight"] = distribute_tensor(full, mesh, [placement])
    for i in range(64):  # small tensors, as biases and norms are
        out[f"norm{i}.weight"] = distribute_tensor(torch.randn(cols, generator=g), mesh, [Shard(0)])
    return out


def _zeros_like(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) for k, v in sd.items()}


def _nbytes(sd: dict[str, Any]) -> int:
    return sum(v.numel() * v.element_size() for v in sd.values())


def _clear(paths: list[str]) -> None:
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


def _timed(fn: Any) -> tuple[float, float, float]:
    """(wall s, blocked s, CPU s of this process) of fn(); fn returns a future or None."""
    dist.barrier()
    c0, t0 = time.process_time(), time.perf_counter()
    fut = fn()
    blocked = time.perf_counter() - t0
    if hasattr(fut, "result"):  # async_save's future (dcp.save returns the metadata)
        fut.result()
    dist.barrier()
    return time.perf_counter() - t0, blocked, time.process_time() - c0


def _worker(rank: int, world: int, init: str, args: dict[str, Any], out: Any) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import fastpersist as fp
    from fastpersist.dcp import Reader, Writer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    sd = _state(args["gib"], Shard(0), mesh, world)
    resharded = _zeros_like(_state(args["gib"], Shard(1), mesh, world))
    same = _zeros_like(sd)
    base = args["base"]
    roots = [os.path.join(base, "root0", "ck"), os.path.join(base, "root1", "ck")]
    group = dist.new_group(backend="gloo")

    def fs_writer(t: int) -> Any:
        return FileSystemWriter(roots[0], thread_count=t, sync_files=True)

    contenders: dict[str, Any] = {
        "fastpersist.dcp": (lambda: dcp.save(sd, storage_writer=Writer(roots)), lambda t: Reader(roots)),
        "fastpersist.dcp async": (lambda: dcp.async_save(sd, storage_writer=Writer(roots), process_group=group),
                                  lambda t: Reader(roots)),
    }
    for t in args["threads"]:
        contenders[f"FileSystemWriter t{t}"] = (lambda t=t: dcp.save(sd, storage_writer=fs_writer(t)),
                                                 lambda t: FileSystemReader(roots[0]))
    contenders[f"FileSystemWriter t{args['threads'][-1]} async"] = (
        lambda: dcp.async_save(sd, storage_writer=fs_writer(args["threads"][-1]), process_group=group),
        lambda t: FileSystemReader(roots[0]))
    cp_roots = {m: [os.path.join(base, "root0", m), os.path.join(base, "root1", m)] for m in ("sync", "snapshot")}
    checkpointers = {"Checkpointer": fp.Checkpointer(cp_roots["sync"], mode="sync", keep=1),
                     "Checkpointer snapshot": fp.Checkpointer(cp_roots["snapshot"], mode="snapshot", keep=1)}

    results: dict[str, dict[str, list[float]]] = {}
    names = [n for n in list(contenders) + list(checkpointers) if not args["only"] or n in args["only"]]
    for r in range(args["rounds"]):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            res = results.setdefault(name, {"save": [], "blocked": [], "cpu": [], "load": [], "reshard": []})
            if rank == 0:
                _clear(roots)
            dist.barrier()
            if name in checkpointers:
                ck = checkpointers[name]
                wall, blocked, cpu = _timed(lambda: ck.save(r, sd))
            else:
                save, reader = contenders[name]
                wall, blocked, cpu = _timed(save)

            def load(into: dict[str, Any]) -> Any:
                if name in checkpointers:
                    return checkpointers[name].load(r, into=into)
                return dcp.load(into, storage_reader=contenders[name][1](0))
            lwall = rwall = float("nan")
            if args["loads"]:
                if rank == 0:
                    drop_caches()
                lwall = _timed(lambda: load(same))[0]
                if rank == 0:
                    drop_caches()
                rwall = _timed(lambda: load(resharded))[0]
            cpus: list[Any] = [None] * world
            dist.all_gather_object(cpus, cpu)
            res["save"].append(wall)
            res["blocked"].append(blocked)
            res["cpu"].append(sum(cpus))
            res["load"].append(lwall)
            res["reshard"].append(rwall)
    for ck in checkpointers.values():
        ck.close()
    if rank == 0:
        out.put((results, _nbytes(sd)))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", default="1,4", help="FileSystemWriter thread counts")
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--world", type=int, default=WORLD, help="ranks (processes) on this one node")
    p.add_argument("--only", default="", help="comma-separated contenders to run (default: all)")
    p.add_argument("--no-loads", action="store_true", help="measure saves only")
    a = p.parse_args(argv)
    base = tempfile.mkdtemp(prefix="fp-bench-dcp-", dir=a.dir)
    device = device_summary(base, int(a.gib * (1 << 30)))
    device_write = float(device.split("write ")[1].split(" GB/s")[0])
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    args = {"gib": a.gib, "rounds": a.rounds, "threads": [int(t) for t in a.threads.split(",")], "base": base,
            "only": [n for n in a.only.split(",") if n], "loads": not a.no_loads}
    try:
        mp.start_processes(_worker, args=(a.world, f"file://{base}/rdv", args, q), nprocs=a.world, start_method="spawn")
        results, nbytes = q.get(timeout=10)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    gb = nbytes / 1e9
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    print(f"# Sharded state through DCP: {a.world} gloo ranks, 2 roots on one disk, {nbytes / 2**30:.2f} GiB DTensor "
          f"state (Shard(0)); {cores} cores; torch {torch.__version__}; {a.rounds} rounds, median [min-max]; "
          f"{device}\n")
    print("| contender | save GB/s (durable) | of the device | blocked s | CPU s / GB | load GB/s | reshard-load GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {median_spread([gb / t for t in r['save']])} | "
              f"{median_spread([gb / t / device_write for t in r['save']])} | {median_spread(r['blocked'])} | "
              f"{median_spread([c / gb for c in r['cpu']])} | {median_spread([gb / t for t in r['load']])} | "
              f"{median_spread([gb / t for t in r['reshard']])} |")
    if f"FileSystemWriter t{args['threads'][0]}" not in results:
        return 0
    fs1 = statistics.median(results[f"FileSystemWriter t{args['threads'][0]}"]["save"])
    best = min(statistics.median(results[f"FileSystemWriter t{t}"]["save"]) for t in args["threads"]
               if f"FileSystemWriter t{t}" in results)
    for name in ("fastpersist.dcp", "Checkpointer"):
        if name not in results:
            continue
        mine = statistics.median(results[name]["save"])
        print(f"{name} save vs FileSystemWriter t{args['threads'][0]}: {fs1 / mine:.2f}x; vs its best thread "
              f"count: {best / mine:.2f}x")
    for name in ("fastpersist.dcp", "Checkpointer"):
        r = results.get(name)
        if r is None or not args["loads"]:
            continue
        print(f"{name} reshard-load / same-layout load: "
              f"{statistics.median(r['load']) / statistics.median(r['reshard']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
