"""Copies across nodes: what redundancy costs a save, and what a lost node costs a restore.

Four simulated nodes on this machine (one gloo rank each, two private roots each, a backend that
refuses other nodes' paths: ``fastpersist.storage.faults.NodeLocal``) save one state with
``Checkpointer(mode="sync")``, round after round, alternating:

- ``replicated``: a model-like replicated state (--mib MiB), ``redundancy=1`` vs ``2``;
- ``FSDP2``: the same bytes as DTensors sharded over the 4 ranks, ``redundancy=1`` vs ``2``
  (each rank's shards copied to a partner on the next node).

Then the ``redundancy=2`` checkpoints are restored (``Checkpointer.load``, page cache dropped
first): with every node present, and after losing node 2 (its roots moved away; an empty
replacement). Reported: save GB/s (the state's bytes over the slowest rank's time), median
[min-max] and ratio to r=1 in the same round; bytes written and bytes sent between nodes per
save; restore seconds and the lost-node/all-present ratio per round.

All "nodes" share this machine's one disk and two cores, so r=2 writes twice the bytes through
the same device; on real nodes each writes its r/N share on its own disks.

    python benchmarks/bench_nodes.py [--mib 256] [--rounds 3] [--dir /tmp]
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

from _bench.measure import device_summary, drop_caches, machine_facts

WORLD = 4
COLS = 1024


def _tensors(mib: int) -> list[int]:
    rows = (mib << 20) // 4 // COLS
    parts = [rows // 2, rows // 4, rows // 8, rows // 8]
    return [r - r % (8 * WORLD) for r in parts]


def _state(kind: str, mib: int, world: int, fill: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(n, COLS, generator=g) if fill else torch.zeros(n, COLS) for n in _tensors(mib)]
    if kind == "replicated":
        return {f"layer{i}.weight": t for i, t in enumerate(full)}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    return {f"layer{i}.weight": distribute_tensor(t, mesh, [Shard(0)]) for i, t in enumerate(full)}


def _rank(rank: int, world: int, base: str, job: str, kind: str, mib: int, redundancy: int, out: Any) -> None:
    import torch.distributed as dist

    import fastpersist as fp
    from fastpersist.storage.faults import NodeLocal

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{base}/rdv-{job}-{kind}-{redundancy}", rank=rank,
                            world_size=world)
    node = f"node{rank}"
    roots = [os.path.join(base, kind, str(redundancy), node, f"r{j}") for j in range(2)]
    ck = fp.Checkpointer(roots, mode="sync", node=node, redundancy=redundancy,
                         backend=NodeLocal(os.path.join(base, kind, str(redundancy)), node))
    if job == "save":
        state = _state(kind, mib, world, True)
        dist.barrier()
        t0 = time.perf_counter()
        ck.save(0, state)
    else:
        into = _state(kind, mib, world, False)
        if rank == 0:
            drop_caches()
        dist.barrier()
        t0 = time.perf_counter()
        ck.load(0, into=into)
    dist.barrier()
    elapsed = time.perf_counter() - t0
    ck.close()
    if rank == 0:
        out.put(elapsed)
    dist.destroy_process_group()


def _run(base: str, job: str, kind: str, mib: int, redundancy: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(WORLD, base, job, kind, mib, redundancy, q), nprocs=WORLD, start_method="spawn")
    for f in os.listdir(base):
        if f.startswith("rdv-"):
            os.unlink(os.path.join(base, f))
    return float(q.get())


def _written(base: str, kind: str, redundancy: int) -> tuple[int, int]:
    """Bytes on every node's disks for the step, and bytes that crossed between nodes (copies
    of unique bytes: a rank's DTensor pieces or rank_state, written by a partner)."""
    import fastpersist as fp
    from fastpersist.format import copies

    top = os.path.join(base, kind, str(redundancy))
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(top) for f in fs
                if "step-" in d and not f.startswith("manifest"))
    m = fp.open([os.path.join(top, "node0", f"r{j}") for j in range(2)]).manifest(0)
    moved = sum(e.nbytes * len(e.copies) for what, e in copies.extents(m) if not what.startswith("object 'replicated'"))
    return total, moved


def _spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} [{min(xs):.2f}-{max(xs):.2f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    base = tempfile.mkdtemp(prefix="fp-bench-nodes-", dir=args.dir)
    nbytes = sum(n * COLS * 4 for n in _tensors(args.mib))
    print(machine_facts(base))
    print(device_summary(base, 1 << 30))
    print(f"state: {nbytes / 1e6:.0f} MB in 4 tensors; {WORLD} nodes of 1 rank, 2 roots each\n")
    saves: dict[tuple[str, int], list[float]] = {}
    ratios: dict[str, list[float]] = {}
    restore: dict[str, list[float]] = {"all": [], "lost": [], "ratio": []}
    try:
        for rnd in range(args.rounds):
            for kind in ("replicated", "fsdp"):
                times = {}
                for r in ((1, 2) if rnd % 2 == 0 else (2, 1)):
                    shutil.rmtree(os.path.join(base, kind, str(r)), ignore_errors=True)
                    times[r] = _run(base, "save", kind, args.mib, r)
                    saves.setdefault((kind, r), []).append(nbytes / times[r] / 1e9)
                ratios.setdefault(kind, []).append(times[1] / times[2])
            top = os.path.join(base, "replicated", "2")
            order = ("all", "lost") if rnd % 2 == 0 else ("lost", "all")
            got = {}
            for case in order:
                if case == "lost":
                    os.rename(os.path.join(top, "node2"), os.path.join(base, "node2-away"))
                got[case] = _run(base, "load", "replicated", args.mib, 2)
                if case == "lost":
                    shutil.rmtree(os.path.join(top, "node2"), ignore_errors=True)
                    os.rename(os.path.join(base, "node2-away"), os.path.join(top, "node2"))
            restore["all"].append(got["all"])
            restore["lost"].append(got["lost"])
            restore["ratio"].append(got["lost"] / got["all"])
            print(f"round {rnd + 1}: " + ", ".join(f"{k} r={r} {v[-1]:.2f} GB/s" for (k, r), v in saves.items())
                  + f"; restore all {got['all']:.2f} s, lost node {got['lost']:.2f} s", file=sys.stderr)
        print("| state | redundancy | save GB/s median [min-max] | r=2 speed / r=1 (per round) | bytes written | "
              "bytes sent between nodes |")
        print("|---|---|---|---|---|---|")
        for kind in ("replicated", "fsdp"):
            for r in (1, 2):
                written, moved = _written(base, kind, r)
                rel = _spread(ratios[kind]) if r == 2 else "1"
                print(f"| {'FSDP2' if kind == 'fsdp' else kind} | {r} | {_spread(saves[(kind, r)])} | {rel} | "
                      f"{written / 1e6:.0f} MB | {moved / 1e6:.0f} MB |")
        print()
        print("| restore (replicated, r=2, 4 nodes) | seconds median [min-max] |")
        print("|---|---|")
        print(f"| every node present | {_spread(restore['all'])} |")
        print(f"| node 2 lost, empty replacement | {_spread(restore['lost'])} |")
        print(f"| lost / present (per round) | {_spread(restore['ratio'])} |")
    finally:
        shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    main()
