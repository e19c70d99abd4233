"""Loads against the device's read speed: single file, replicated and sharded checkpoints, cold.

Each checkpoint is written once. Then, round after round (the order rotated), every contender
runs in a fresh process (memory as cold as a restarted job's), after the page cache is dropped:

- ``device``: fio reading fresh files of the same size in all with O_DIRECT, in three
  configurations (one file: 64 MiB requests x 4 in flight, 8 MiB x 16; four files read side by
  side: 8 MiB x 4 each); a round's device speed is the fastest of the three;
- ``single file``: ``fastpersist.load`` of a ``fastpersist.save`` file, checksums verified;
  ``torch.load`` of the same file beside it;
- ``replicated``: ``fastpersist.open(roots).load()`` at 1 process of a GPT-like state that one
  process saved with the Checkpointer over 2 roots;
- ``sharded``: a Shard(0) DTensor state saved by 4 gloo ranks over 2 roots, loaded at the same
  layout with ``fastpersist.open(roots).load(into=...)``; DCP's ``FileSystemReader`` loading the
  same state that DCP's ``FileSystemWriter`` saved beside it.

Every load process has imported what it loads with and run one full garbage collection before
the clock starts, as a job that built its model has: the first full collection after importing
torch (~60 ms here) belongs to no load.

Reported: GB/s (tensor bytes over the load's wall time; for several ranks, the slowest rank's
time between two barriers), median [min-max] over rounds, and the median of each round's ratio
to that round's device speed.

    python benchmarks/bench_load.py [--gib 1] [--rounds 3] [--dir /tmp] [--only NAME,...]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any

import torch
import torch.multiprocessing as mp

from _bench.measure import drop_caches
from _bench.state import gpt_state, tensor_bytes
from _bench.stats import median_spread

WORLD = 4
COLS = 1024
MiB = 1 << 20


def _rows(gib: float) -> list[int]:
    total = int(gib * (1 << 30)) // 4 // COLS
    rows = [total // 2, total // 4, total // 8, total // 8]
    return [r - r % (WORLD * 8) for r in rows]


def _sharded(rows: list[int], fill: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    g = torch.Generator().manual_seed(0)
    out = {f"layer{i}.weight": distribute_tensor(torch.randn(n, COLS, generator=g) if fill else torch.zeros(n, COLS),
                                                 mesh, [Shard(0)])
           for i, n in enumerate(rows)}
    for i in range(64):  # small tensors, as biases and norms are
        out[f"norm{i}.weight"] = distribute_tensor(torch.randn(COLS, generator=g) if fill else torch.zeros(COLS),
                                                   mesh, [Shard(0)])
    return out


def _ranks(rank: int, base: str, job: str, rows: list[int], out: Any) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    import fastpersist as fp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{base}/rdv-{job}", rank=rank, world_size=WORLD)
    roots = [os.path.join(base, "sharded0"), os.path.join(base, "sharded1")]
    dcp_dir = os.path.join(base, "dcp")
    if job == "save":
        state = _sharded(rows, True)
        with fp.Checkpointer(roots, mode="sync") as ck:
            ck.save(0, state)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(dcp_dir, sync_files=True, thread_count=4))
    else:
        into = _sharded(rows, False)
        import fastpersist.loading.view  # noqa: F401
        gc.collect()
        dist.barrier()
        t0 = time.perf_counter()
        if job.startswith("fastpersist"):
            fp.open(roots).load(0, into=into)
        else:
            dcp.load(into, storage_reader=dcp.FileSystemReader(dcp_dir))
        dist.barrier()
        if rank == 0:
            out.put(time.perf_counter() - t0)
    dist.destroy_process_group()


def _one(kind: str, base: str, out: Any) -> None:
    import fastpersist as fp
    import fastpersist.single_file  # noqa: F401
    import fastpersist.loading.view  # noqa: F401

    torch.set_num_threads(1)
    gc.collect()
    t0 = time.perf_counter()
    if kind == "single":
        fp.load(os.path.join(base, "single.pt"))
    elif kind == "torch":
        torch.load(os.path.join(base, "single.pt"), weights_only=True)
    else:
        fp.open([os.path.join(base, "replicated0"), os.path.join(base, "replicated1")]).load(0)
    out.put(time.perf_counter() - t0)


def _fio(path: str, bs: int, depth: int) -> float:
    cmd = ["fio", "--name=read", f"--filename={path}", "--rw=read", "--direct=1", "--ioengine=libaio",
           f"--bs={bs}", f"--iodepth={depth}", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read"]["runtime"] / 1000.0


def _fio_jobs(directory: str, nbytes: int, jobs: int) -> float:
    """Seconds for ``jobs`` fio jobs to read ``nbytes`` in all, each its own file, side by side."""
    cmd = ["fio", "--name=read", f"--directory={directory}", "--filename_format=probe.$jobnum", "--rw=read",
           "--direct=1", "--ioengine=libaio", f"--bs={8 * MiB}", "--iodepth=4", f"--numjobs={jobs}",
           f"--size={nbytes // jobs}", "--group_reporting", "--output-format=json"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    job = json.loads(out[out.index("{"):])["jobs"][0]
    return job["read"]["runtime"] / 1000.0


def _write_probe(path: str, nbytes: int) -> None:
    subprocess.run(["fio", "--name=write", f"--filename={path}", "--rw=write", "--direct=1", "--ioengine=libaio",
                    f"--bs={64 * MiB}", "--iodepth=4", f"--size={nbytes}", "--end_fsync=1", "--output-format=json"],
                   check=True, capture_output=True)


def _write_probes(directory: str, nbytes: int, jobs: int) -> None:
    os.makedirs(directory)
    for j in range(jobs):
        _write_probe(os.path.join(directory, f"probe.{j}"), nbytes // jobs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--only", default="", help="comma-separated contenders (default: all)")
    a = p.parse_args(argv)
    if shutil.which("fio") is None:
        sys.exit("bench_load needs fio for the device's read speed (apt-get install fio)")
    import fastpersist as fp

    base = tempfile.mkdtemp(prefix="fp-bench-load-", dir=a.dir)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    rows = _rows(a.gib)
    sizes: dict[str, int] = {}
    try:
        state = gpt_state(a.gib)
        sizes["replicated"] = sizes["single"] = sizes["torch"] = tensor_bytes(state)
        fp.save(state, os.path.join(base, "single.pt"))
        with fp.Checkpointer([os.path.join(base, "replicated0"), os.path.join(base, "replicated1")],
                             mode="sync") as ck:
            ck.save(0, state)
        del state
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mp.start_processes(_ranks, args=(base, "save", rows, q), nprocs=WORLD, start_method="spawn")
        sizes["sharded"] = sizes["dcp"] = (sum(rows) + 64) * COLS * 4
        probe = os.path.join(base, "device.bin")
        _write_probe(probe, sizes["single"] // MiB * MiB)
        probes = os.path.join(base, "probes")
        _write_probes(probes, sizes["single"] // (4 * MiB) * 4 * MiB, 4)
        contenders = {
            "device (fio 64 MiB x 4)": lambda: _fio(probe, 64 * MiB, 4),
            "device (fio 8 MiB x 16)": lambda: _fio(probe, 8 * MiB, 16),
            "device (fio 4 files, 8 MiB x 4 each)": lambda: _fio_jobs(probes, sizes["single"] // (4 * MiB) * 4 * MiB, 4),
            "single file: fastpersist.load": lambda: _spawn(ctx, q, "single", base),
            "single file: torch.load": lambda: _spawn(ctx, q, "torch", base),
            "replicated: Checkpointer, 1 process": lambda: _spawn(ctx, q, "replicated", base),
            f"sharded: Checkpointer, {WORLD} ranks": lambda: _ranked(q, base, "fastpersist", rows),
            f"sharded: DCP FileSystemReader, {WORLD} ranks": lambda: _ranked(q, base, "dcp", rows),
        }
        kinds = {"single file: fastpersist.load": "single", "single file: torch.load": "torch",
                 "replicated: Checkpointer, 1 process": "replicated", f"sharded: Checkpointer, {WORLD} ranks": "sharded",
                 f"sharded: DCP FileSystemReader, {WORLD} ranks": "dcp"}
        if a.only:
            keep = a.only.split(",")
            contenders = {k: v for k, v in contenders.items() if k.startswith("device") or any(w in k for w in keep)}
        names = list(contenders)
        gbps: dict[str, list[float]] = {n: [] for n in names}
        ratio: dict[str, list[float]] = {n: [] for n in names}
        for r in range(a.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                drop_caches()
                seconds = contenders[name]()
                nbytes = sizes[kinds[name]] if name in kinds else (
                    os.path.getsize(probe) if "4 files" not in name else sizes["single"] // (4 * MiB) * 4 * MiB)
                gbps[name].append(nbytes / seconds / 1e9)
                print(f"round {r + 1}: {name} {gbps[name][-1]:.2f} GB/s", file=sys.stderr)
            device = max(gbps[n][-1] for n in names if n.startswith("device"))
            for n in names:
                ratio[n].append(gbps[n][-1] / device)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(f"# Loads, cold: {sizes['single'] / 2**30:.2f} GiB GPT-like state (single file, replicated), "
          f"{sizes['sharded'] / 2**30:.2f} GiB Shard(0) DTensor state ({WORLD} ranks); {os.cpu_count()} cores; "
          f"torch {torch.__version__}; {a.rounds} rounds, median [min-max]\n")
    print("| contender | GB/s | of the round's device read |")
    print("|---|---|---|")
    for n in names:
        print(f"| {n} | {median_spread(gbps[n])} | {median_spread(ratio[n])} |")
    return 0


def _spawn(ctx: Any, q: Any, kind: str, base: str) -> float:
    proc = ctx.Process(target=_one, args=(kind, base, q))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"the {kind} load failed (exit {proc.exitcode})")
    return float(q.get(timeout=5))


def _ranked(q: Any, base: str, job: str, rows: list[int]) -> float:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mp.start_processes(_ranks, args=(base, f"{job}-{time.monotonic_ns()}", rows, q), nprocs=WORLD,
                           start_method="spawn")
    return float(q.get(timeout=5))


if __name__ == "__main__":
    sys.exit(main())
