"""Incremental checkpoints: bytes written and save time per checkpoint, against a full save
and torch.save, on three workloads.

* ``lora``: a frozen base model (GPT-like fp32 weights, ``--base-mib``) plus LoRA adapters
  (rank 8 on every matrix) trained by AdamW; the checkpoint holds the base, the adapters and
  their optimizer state, as a fine-tuning job that saves its whole model does.
* ``embedding``: an embedding table (``--table-mib``, 256-wide fp32 rows) and a small dense
  part; each interval updates 1% of the rows, drawn from a Zipf law over the row ids (hot rows
  are the low ids, as in recommendation models whose ids are sorted by frequency).
* ``full``: a GPT-like training state (parameters and Adam's moments, ``--full-mib``) where
  every tensor changes every interval (what pretraining does): incremental must cost nothing.

Every round applies one interval's update, then each contender saves the same state, in an
order that rotates from round to round (the disk drifts), the disk left idle ``--settle``
seconds before each save (the save before it otherwise slows it: measured here, the second of
two back-to-back 1 GiB saves took 15-40% longer whichever it was). A contender keeps its own
Checkpointer (sync mode, keep=2) across rounds, so its incremental saves have their last
checkpoint; the first save of each contender is a warm-up, not counted. Each save is timed from
the call until it is durable (committed, or fsync'd for torch.save). The table gives per
contender the median [min-max] of bytes written and seconds per save, and the paired per-round
ratio of incremental to full (median, bootstrap 95% interval).

    python benchmarks/bench_incremental.py --dir /var/tmp/fp-bench --rounds 7
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from _bench.savers import save_torch
from _bench.state import gpt_state, tensor_bytes
from _bench.stats import median_spread, overhead
from fastpersist.checkpointer import Checkpointer

MiB = 1 << 20


def lora_workload(base_mib: int, seed: int = 0) -> tuple[dict[str, Any], Callable[[], None]]:
    base = gpt_state(base_mib / 1024 * 3, seed)["model"]  # gpt_state's parameters are a third of it
    g = torch.Generator().manual_seed(seed + 1)
    adapters: dict[str, torch.nn.Parameter] = {}
    for name, w in base.items():
        if w.dim() == 2 and not name.startswith("wte"):
            adapters[name + ".lora_A"] = torch.nn.Parameter(torch.randn(8, w.shape[1], generator=g) * 0.01)
            adapters[name + ".lora_B"] = torch.nn.Parameter(torch.zeros(w.shape[0], 8))
    opt = torch.optim.AdamW(adapters.values(), lr=1e-3)

    def update() -> None:
        for p in adapters.values():
            p.grad = torch.randn(p.shape, generator=g) * 1e-3
        opt.step()

    update()  # the optimizer's state exists from the first checkpoint on
    state = {"model": {**base, **{k: v.data for k, v in adapters.items()}}, "optim": opt.state_dict()}
    return state, update


def embedding_workload(table_mib: int, seed: int = 0) -> tuple[dict[str, Any], Callable[[], None]]:
    g = torch.Generator().manual_seed(seed)
    rows = table_mib * MiB // (256 * 4)
    table = torch.randn(rows, 256, generator=g)
    dense = {f"mlp.{i}": torch.randn(512, 512, generator=g) for i in range(4)}
    ranks = torch.arange(1, rows + 1, dtype=torch.float64)
    zipf = ranks.pow(-1.1)
    zipf /= zipf.sum()

    def update() -> None:
        touched = torch.multinomial(zipf, max(1, rows // 100), replacement=True, generator=g).unique()
        with torch.no_grad():
            table[touched] += 0.01 * torch.randn(len(touched), 256, generator=g)
            for t in dense.values():
                t.mul_(0.999)

    return {"emb": table, "dense": dense}, update


def full_workload(full_mib: int, seed: int = 0) -> tuple[dict[str, Any], Callable[[], None]]:
    state = gpt_state(full_mib / 1024, seed)
    tensors = [t for t in state["model"].values()] + [
        t for s in state["optim"]["state"].values() for t in s.values() if t.dim() > 0]

    def update() -> None:
        with torch.no_grad():
            for t in tensors:
                t.mul_(0.9999).add_(1e-6)

    return state, update


def run(name: str, state: dict[str, Any], update: Callable[[], None], workdir: str, rounds: int,
        log: Callable[[str], None], small_units: bool = False, settle: float = 1.0) -> dict[str, dict[str, list[float]]]:
    kinds: dict[str, bool | int | None] = {"fastpersist full": False, "fastpersist incremental": True,
                                           "torch.save": None}
    if small_units:
        kinds["fastpersist incremental, 64 KiB units"] = 64 << 10
    contenders = list(kinds)
    dirs = {c: os.path.join(workdir, name, f"c{i}") for i, c in enumerate(contenders)}
    cks = {c: Checkpointer(dirs[c], mode="sync", keep=2, incremental=k) for c, k in kinds.items() if k is not None}
    out: dict[str, dict[str, list[float]]] = {c: {"bytes": [], "s": []} for c in contenders}
    try:
        for r in range(rounds + 1):
            update()
            k = r % len(contenders)
            order = contenders[k:] + contenders[:k]
            for c in order:
                time.sleep(settle)  # the disk idle before each save: the one before must not slow it
                t0 = time.perf_counter()
                if c == "torch.save":
                    path = os.path.join(dirs[c], f"step-{r}.pt")
                    os.makedirs(dirs[c], exist_ok=True)
                    save_torch(state, path)
                    written = os.path.getsize(path)
                    for old in os.listdir(dirs[c]):
                        if old != os.path.basename(path):
                            os.unlink(os.path.join(dirs[c], old))
                else:
                    metrics = cks[c].save(r, state).metrics
                    written = metrics.bytes_written
                    if r > 0:
                        out[c].setdefault("probe", []).append(metrics.probe_s)
                seconds = time.perf_counter() - t0
                if r > 0:  # round 0 is the warm-up (and incremental's first, full save)
                    out[c]["bytes"].append(written)
                    out[c]["s"].append(seconds)
            log(f"  {name} round {r}/{rounds}")
    finally:
        for ck in cks.values():
            ck.close()
    return out


def table(name: str, total: int, out: dict[str, dict[str, list[float]]]) -> str:
    lines = [f"### {name}: checkpoint of {total / MiB:.0f} MiB",
             "",
             "| contender | MiB written per save | s per save | GB/s of checkpoint |",
             "|---|---|---|---|"]
    for c, m in out.items():
        rate = [total / s / 1e9 for s in m["s"]]
        lines.append(f"| {c} | {median_spread([b / MiB for b in m['bytes']], 1)} | {median_spread(m['s'], 3)} | "
                     f"{median_spread(rate, 2)} |")
    lines.append("")
    full = out["fastpersist full"]
    for c, m in out.items():
        if "incremental" in c:
            written = statistics.median(m["bytes"]) / max(1.0, statistics.median(full["bytes"]))
            probe = [p / t for p, t in zip(m["probe"], m["s"])]
            lines.append(f"- {c} vs full save: time per save {overhead(full['s'], m['s'])}; bytes written "
                         f"{written:.3f} of full; finding unchanged units took {median_spread([p * 1e3 for p in m['probe']], 1)}"
                         f" ms per save, {median_spread([x * 100 for x in probe], 2)}% of its save; torch.save's time "
                         f"vs it: {overhead(m['s'], out['torch.save']['s'])}")
    lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory under /var/tmp)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--base-mib", type=int, default=384)
    ap.add_argument("--table-mib", type=int, default=256)
    ap.add_argument("--full-mib", type=int, default=512)
    ap.add_argument("--only", choices=["lora", "embedding", "full"], action="append")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds the disk is left idle before each save")
    args = ap.parse_args(argv)
    workdir = args.dir or tempfile.mkdtemp(prefix="fp-bench-incremental-", dir="/var/tmp")
    os.makedirs(workdir, exist_ok=True)
    torch.set_num_threads(1)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    workloads = {"lora": lambda: lora_workload(args.base_mib), "embedding": lambda: embedding_workload(args.table_mib),
                 "full": lambda: full_workload(args.full_mib)}
    try:
        for name in args.only or list(workloads):
            state, update = workloads[name]()
            total = tensor_bytes(state)
            out = run(name, state, update, workdir, args.rounds, log, small_units=name == "embedding",
                      settle=args.settle)
            print(table(name, total, out), flush=True)
            del state, update
    finally:
        if args.dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
