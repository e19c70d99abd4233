"""Sweep the write engine's knobs (chunk size, buffers, writer threads) on one state.

Configurations alternate within each round so the disk's drift hits them alike; prints the
median and spread of GB/s and CPU cores per configuration. Used to pick IOConfig's defaults.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics

from _bench.measure import GB, measure
from _bench.state import gpt_state, tensor_bytes

import fastpersist as fp
from fastpersist.config import IOConfig, MiB


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="bench-work")
    ap.add_argument("--configs", default="8x8x2,16x4x2,32x4x2,64x4x2,32x4x1,32x4x4,64x2x1",
                    help="CHUNK_MBxBUFFERSxWRITERS,...")
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    state = gpt_state(args.gib)
    payload = tensor_bytes(state)
    configs = {}
    for c in args.configs.split(","):
        chunk, bufs, writers = (int(x) for x in c.split("x"))
        configs[c] = IOConfig(chunk_bytes=chunk * MiB, num_buffers=bufs, writer_threads=writers)
    gbps: dict[str, list[float]] = {c: [] for c in configs}
    cores: dict[str, list[float]] = {c: [] for c in configs}
    path = os.path.join(args.dir, "tune.pt")
    for r in range(args.rounds):
        for name, cfg in configs.items():
            s, _ = measure(functools.partial(fp.save, state, path, config=cfg))
            gbps[name].append(payload / s.seconds / GB)
            cores[name].append(s.cpu_seconds / s.seconds)
            os.unlink(path)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    print(f"\n{args.gib:g} GiB GPT-like state, {payload / GB:.2f} GB, rounds={args.rounds}\n")
    print("| chunk MiB x buffers x writers | GB/s median [min-max] | CPU cores median |")
    print("|---|---|---|")
    for name in configs:
        g = gbps[name]
        print(f"| {name} | {statistics.median(g):.2f} [{min(g):.2f}-{max(g):.2f}] | {statistics.median(cores[name]):.2f} |")


if __name__ == "__main__":
    main()
