"""``fastpersist bench``: fastpersist.save/load against torch.save, DCP and the device itself.

Every round runs all contenders one after the other on the same state dict and the same disk,
so that the disk's drift hits them alike; the table gives the median and the spread
[min-max] over rounds, and ratios of medians measured in this run. Loads start from a cold page
cache (``/proc/sys/vm/drop_caches`` when writable; the table says when it was not).

Each save writes a new file: the contender's previous output is removed, and the disk left idle
for ``--settle`` seconds, before the clock starts; the order of the save contenders rotates
from round to round (the disk slows under sustained writes). (Replacing an existing multi-GB file frees its blocks inside the timed region;
on this machine's ext4, mounted with ``discard``, that alone cost fastpersist.save 30%: 1.70 vs
2.43 GB/s for 2 GiB. Deleting old checkpoints is retention's job, off the critical path.)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

import fastpersist as fp
from _bench.measure import GB, MiB, Sample, device_probe, drop_caches, machine_facts, measure, remove
from _bench.savers import save_dcp, save_torch
from _bench.state import gpt_state, tensor_bytes
from _bench.stats import median_spread
from fastpersist.cli.progress import Progress, wanted


# ------------------------------------------------------------------------------- the run


@dataclass
class Series:
    name: str
    kind: str  # "save" | "load"
    gbps: list[float] = field(default_factory=list)
    cpu_per_gb: list[float] = field(default_factory=list)
    rss_mib: list[float] = field(default_factory=list)
    note: str = ""

    def add(self, s: Sample, payload: int, gbps: float | None = None) -> None:
        self.gbps.append(gbps if gbps is not None else payload / s.seconds / GB)
        self.cpu_per_gb.append(s.cpu_seconds / (payload / GB))
        self.rss_mib.append(s.peak_rss_delta / MiB)


def run_size(
    gib: float, rounds: int, workdir: str, dcp_threads: int, log: Callable[[str], None], settle: float = 2.0,
    probe_bytes: int | None = None, progress: Progress | None = None,
) -> tuple[dict[str, Series], int]:
    state = gpt_state(gib)
    payload = tensor_bytes(state)
    probe = probe_bytes or max(1, min(4, round(gib))) * (1 << 30)
    paths = {n: os.path.join(workdir, n) for n in ("torch.pt", "dcp", "fastpersist.pt", "fio.bin")}
    series = {
        "device write": Series("device write", "save"),
        "torch.save+fsync": Series("torch.save+fsync", "save"),
        f"DCP FileSystemWriter t{dcp_threads}": Series(f"DCP FileSystemWriter t{dcp_threads}", "save"),
        "fastpersist.save": Series("fastpersist.save", "save"),
        "device read": Series("device read", "load"),
        "torch.load": Series("torch.load", "load"),
        "fastpersist.load": Series("fastpersist.load", "load"),
    }
    dcp_name = f"DCP FileSystemWriter t{dcp_threads}"
    cold = True

    def tick(name: str) -> None:  # one timed run done (the progress bar counts runs)
        if progress is not None:
            progress.describe(f"{gib:g} GiB {name}")
            progress(1)

    for r in range(rounds):
        log(f"  {gib:g} GiB round {r + 1}/{rounds}: saves")
        saves: list[tuple[str, str, Callable[[], None]]] = [
            ("device write", "fio.bin", lambda: None),
            ("torch.save+fsync", "torch.pt", lambda: save_torch(state, paths["torch.pt"])),
            (dcp_name, "dcp", lambda: save_dcp(state, paths["dcp"], threads=dcp_threads)),
            ("fastpersist.save", "fastpersist.pt", lambda: fp.save(state, paths["fastpersist.pt"])),
        ]
        # Rotate the order every round: the disk slows down under sustained writes, so no
        # contender may always come first (after idle time) or last (after 10 GB of writes).
        k = r % len(saves)
        for name, output, fn in saves[k:] + saves[:k]:
            remove(paths[output])
            os.sync()
            time.sleep(settle)
            if name == "device write":
                s, gbps, note = device_probe(paths["fio.bin"], "write", probe)
                series[name].add(s, probe, gbps)
                series["device write"].note = series["device read"].note = note
            else:
                s, _ = measure(fn)
                series[name].add(s, payload)
            tick(name)

        log(f"  {gib:g} GiB round {r + 1}/{rounds}: loads")
        cold &= drop_caches()
        s, gbps, _ = device_probe(paths["fio.bin"], "read", probe)
        series["device read"].add(s, probe, gbps)
        tick("device read")
        for name, fn in (
            ("torch.load", lambda: torch.load(paths["torch.pt"], weights_only=True)),
            ("fastpersist.load", lambda: fp.load(paths["fastpersist.pt"])),
        ):
            cold &= drop_caches()
            s, out = measure(fn)
            series[name].add(s, payload)
            tick(name)
            del out
    if not cold:
        for n in ("torch.load", "fastpersist.load"):
            series[n].note = "page cache NOT dropped (no permission): warm-cache figure"
    remove(*paths.values())
    return series, payload


def table(gib: float, payload_gb: float, series: dict[str, Series]) -> str:
    lines = [
        f"### {gib:g} GiB state ({payload_gb:.2f} GB of tensors), rounds={len(next(iter(series.values())).gbps)}",
        "",
        "| contender | op | GB/s median [min-max] | CPU s per GB | peak RSS over start, MiB | note |",
        "|---|---|---|---|---|---|",
    ]
    for s in series.values():
        lines.append(f"| {s.name} | {s.kind} | {median_spread(s.gbps)} | {median_spread(s.cpu_per_gb)} | {median_spread(s.rss_mib, 0)} | {s.note} |")
    med = {k: statistics.median(v.gbps) for k, v in series.items()}
    cpu = {k: statistics.median(v.cpu_per_gb) for k, v in series.items()}
    dcp = next(k for k in series if k.startswith("DCP"))
    fps, fpl = med["fastpersist.save"], med["fastpersist.load"]
    lines += [
        "",
        "| ratio (medians, this run) | value |",
        "|---|---|",
        f"| fastpersist.save / device write | {fps / med['device write']:.2f} |",
        f"| fastpersist.save / torch.save+fsync | {fps / med['torch.save+fsync']:.2f} |",
        f"| fastpersist.save / {dcp} | {fps / med[dcp]:.2f} |",
        f"| fastpersist.load / device read | {fpl / med['device read']:.2f} |",
        f"| fastpersist.load / torch.load | {fpl / med['torch.load']:.2f} |",
        f"| CPU per GB saved: fastpersist / torch.save | {cpu['fastpersist.save'] / cpu['torch.save+fsync']:.2f} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else list(argv)
    if "--gpu" in args_in:  # the prepared GPU run (gpu_check.py, beside this file), with its own options
        import gpu_check

        return gpu_check.main([a for a in args_in if a != "--gpu"])
    ap = argparse.ArgumentParser(prog="fastpersist bench", description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", action="store_true", help="run the prepared GPU check instead (see --gpu --help)")
    ap.add_argument("--sizes", default="1", help="state sizes in GiB, comma-separated (default 1)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (4 = every save contender in every position)")
    ap.add_argument("--dir", default=os.getcwd(),
                    help="where to work (a real disk); the run uses a new subdirectory of it and removes only that")
    ap.add_argument("--dcp-threads", type=int, default=4)
    ap.add_argument("--settle", type=float, default=2.0, help="idle seconds before each timed save")
    ap.add_argument("--probe-mib", type=int, default=None,
                    help="bytes of the device probe (default: the state's size, 1-4 GiB)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = ap.parse_args(args_in)
    sizes = [float(x) for x in args.sizes.split(",")]
    runs = len(sizes) * args.rounds * 7  # timed runs: 4 saves and 3 loads per round
    bar = Progress(runs, "bench", enabled=wanted(args.quiet), unit="run")

    def log(msg: str) -> None:  # where the run is: a diagnostic, on stderr (results go to stdout)
        print(msg, file=sys.stderr, flush=True)

    os.makedirs(args.dir, exist_ok=True)
    workdir = tempfile.mkdtemp(prefix="fastpersist-bench-", dir=args.dir)  # ours: the only thing we remove
    try:
        log(machine_facts(workdir))
        log(f"fastpersist IO config: {fp.get_config()}")
        log("state memory: warm (created in this process just before the runs); loads: page cache dropped before each")
        results = {}
        probe = args.probe_mib * MiB if args.probe_mib else None
        for gib in sizes:
            series, payload = run_size(gib, args.rounds, workdir, args.dcp_threads, log, args.settle, probe, bar)
            print()
            print(table(gib, payload / GB, series), flush=True)
            print()
            results[str(gib)] = {k: asdict(v) for k, v in series.items()}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        bar.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
