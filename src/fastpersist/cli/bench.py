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
import errno
import gc
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

import fastpersist as fp
from fastpersist.cli._progress import Progress

GB = 1e9
MiB = 1 << 20


# ------------------------------------------------------------------------------- the state


def gpt_state(gib: float, seed: int = 0) -> dict[str, object]:
    """A GPT-like training state of about ``gib`` GiB: parameters plus Adam's two moments.

    Parameters are a few large matrices (embeddings, attention and MLP weights) and many small
    vectors (biases, layer norms); the optimizer state mirrors them, as Adam's state_dict does.
    """
    total = int(gib * (1 << 30))
    param_bytes = total // 3
    d = 1024
    while d > 64 and 12 * d * d * 4 > param_bytes // 2:  # small states: narrower layers
        d //= 2
    layers = max(1, min(24, param_bytes // (12 * d * d * 4)))
    per_layer = 12 * d * d * 4
    vocab = max(1024, (param_bytes - layers * per_layer) // (d * 4))
    g = torch.Generator().manual_seed(seed)
    model: dict[str, torch.Tensor] = {"wte.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        p = f"h.{i}."
        model[p + "ln_1.weight"] = torch.ones(d)
        model[p + "ln_1.bias"] = torch.zeros(d)
        model[p + "attn.c_attn.weight"] = torch.randn(d, 3 * d, generator=g)
        model[p + "attn.c_attn.bias"] = torch.randn(3 * d, generator=g)
        model[p + "attn.c_proj.weight"] = torch.randn(d, d, generator=g)
        model[p + "attn.c_proj.bias"] = torch.randn(d, generator=g)
        model[p + "ln_2.weight"] = torch.ones(d)
        model[p + "ln_2.bias"] = torch.zeros(d)
        model[p + "mlp.c_fc.weight"] = torch.randn(d, 4 * d, generator=g)
        model[p + "mlp.c_fc.bias"] = torch.randn(4 * d, generator=g)
        model[p + "mlp.c_proj.weight"] = torch.randn(4 * d, d, generator=g)
        model[p + "mlp.c_proj.bias"] = torch.randn(d, generator=g)
    model["ln_f.weight"] = torch.ones(d)
    model["ln_f.bias"] = torch.zeros(d)
    optim_state = {
        i: {"step": torch.tensor(100.0), "exp_avg": torch.randn(t.shape, generator=g) * 1e-3,
            "exp_avg_sq": torch.rand(t.shape, generator=g) * 1e-6}
        for i, t in enumerate(model.values())
    }
    optim = {
        "state": optim_state,
        "param_groups": [{"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "params": list(range(len(model)))}],
    }
    return {"model": model, "optim": optim, "step": 100}


def tensor_bytes(obj: object) -> int:
    seen: set[int] = set()
    total = 0

    def walk(o: object) -> None:
        nonlocal total
        if isinstance(o, torch.Tensor):
            s = o.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(o, dict):
            for v in o.values():
                walk(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                walk(v)

    walk(obj)
    return total


# ------------------------------------------------------------------------------- measuring


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class Sample:
    seconds: float
    cpu_seconds: float
    peak_rss_delta: int


def measure(fn: Callable[[], object]) -> tuple[Sample, object]:
    """Wall time, process CPU time (all threads) and peak RSS above the starting RSS."""
    gc.collect()
    start_rss = _rss()
    peak = start_rss
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.wait(0.005):
            peak = max(peak, _rss())

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    stop.set()
    t.join()
    peak = max(peak, _rss())
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return Sample(dt, cpu, peak - start_rss), out


def drop_caches() -> bool:
    subprocess.run(["sync"], check=False)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------------- contenders


def _fio(path: str, rw: str, size: int) -> tuple[Sample, float]:
    cmd = [
        "fio", "--name=probe", f"--filename={path}", f"--rw={rw}", "--direct=1", "--ioengine=libaio",
        f"--bs={min(64 * MiB, size)}", "--iodepth=4", f"--size={size}", "--output-format=json",
    ]
    if rw == "write":
        cmd.append("--end_fsync=1")
    t0 = time.perf_counter()
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    dt = time.perf_counter() - t0
    job = json.loads(out[out.index("{"):])["jobs"][0]
    cpu_frac = (job["usr_cpu"] + job["sys_cpu"]) / 100.0
    side = job["write"] if rw == "write" else job["read"]
    runtime = side["runtime"] / 1000.0 or dt
    return Sample(runtime, cpu_frac * runtime, 0), size / runtime / GB


def _raw_probe(path: str, rw: str, size: int, direct: bool = True) -> tuple[Sample, float]:
    """The device's limit without fio: O_DIRECT 64 MiB requests from one aligned buffer
    (``direct=False``: buffered requests, and an fsync after writing)."""
    from fastpersist.io.buffers import aligned_empty, memory_view
    from fastpersist.io.files import O_DIRECT, pread_into, pwrite_all

    request = min(64 * MiB, size)
    buf = aligned_empty(request, pin=False)
    buf.fill_(7)
    view = memory_view(buf.data_ptr(), request)
    total = size - size % request

    def run() -> None:
        flags = (os.O_WRONLY | os.O_CREAT | os.O_TRUNC) if rw == "write" else os.O_RDONLY
        fd = os.open(path, flags | (O_DIRECT if direct else 0), 0o644)
        try:
            for off in range(0, total, request):
                if rw == "write":
                    pwrite_all(fd, view, off)
                else:
                    pread_into(fd, view, off)
            if rw == "write":
                os.fsync(fd)
        finally:
            os.close(fd)

    s, _ = measure(run)
    return s, total / s.seconds / GB


def device_summary(directory: str, nbytes: int) -> str:
    """One line for a benchmark's header: the device's O_DIRECT write and (cold) read of about
    ``nbytes`` in ``directory``, measured now (every speed here is a ratio to the same run)."""
    probe = os.path.join(directory, "device.bin")
    size = max(MiB, nbytes // MiB * MiB)
    try:
        _, write, how = device_probe(probe, "write", size)
        drop_caches()
        _, read, _ = device_probe(probe, "read", size)
    finally:
        if os.path.exists(probe):
            os.remove(probe)
    return f"device ({how}, same run): write {write:.2f} GB/s, read {read:.2f} GB/s"


def device_probe(path: str, rw: str, size: int) -> tuple[Sample, float, str]:
    """The device's sequential O_DIRECT write or read of ``size`` bytes (a multiple of 4 KiB).

    fio when installed; else (or if fio fails) a raw O_DIRECT probe; where the filesystem
    refuses O_DIRECT (EINVAL: some sandboxes, FUSE, tmpfs), buffered I/O, and the note says so.
    """
    bs = f"{min(64 * MiB, size) // MiB}M"
    why = "fio not installed"
    if shutil.which("fio"):
        try:
            s, gbps = _fio(path, rw, size)
            return s, gbps, f"fio libaio O_DIRECT bs={bs} iodepth=4"
        except (subprocess.CalledProcessError, ValueError, KeyError) as e:
            why = f"fio failed: {type(e).__name__}"
    try:
        s, gbps = _raw_probe(path, rw, size)
        return s, gbps, f"raw O_DIRECT probe, {bs} requests ({why})"
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    s, gbps = _raw_probe(path, rw, size, direct=False)
    return s, gbps, f"BUFFERED probe, {bs} requests: O_DIRECT refused by the filesystem ({why})"


def save_torch(state: object, path: str) -> None:
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def save_dcp(state: dict[str, object], path: str, threads: int) -> None:
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=threads)
    with warnings.catch_warnings():  # "torch.distributed is disabled ...": single process by design
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=writer, no_dist=True)


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


def _fmt(xs: list[float], digits: int = 2) -> str:
    if not xs:
        return "-"
    return f"{statistics.median(xs):.{digits}f} [{min(xs):.{digits}f}-{max(xs):.{digits}f}]"


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
            (dcp_name, "dcp", lambda: save_dcp(state, paths["dcp"], dcp_threads)),
            ("fastpersist.save", "fastpersist.pt", lambda: fp.save(state, paths["fastpersist.pt"])),
        ]
        # Rotate the order every round: the disk slows down under sustained writes, so no
        # contender may always come first (after idle time) or last (after 10 GB of writes).
        k = r % len(saves)
        for name, output, fn in saves[k:] + saves[:k]:
            _remove(paths[output])
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
    _remove(*paths.values())
    return series, payload


def _remove(*paths: str) -> None:
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)
    subprocess.run(["sync"], check=False)


def machine_facts(workdir: str) -> str:
    fs = subprocess.run(["df", "-T", workdir], capture_output=True, text=True).stdout.splitlines()[-1].split()
    return (
        f"machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, "
        f"torch {torch.__version__}; workdir {workdir} on {fs[0]} ({fs[1]})"
    )


def table(gib: float, payload_gb: float, series: dict[str, Series]) -> str:
    lines = [
        f"### {gib:g} GiB state ({payload_gb:.2f} GB of tensors), rounds={len(next(iter(series.values())).gbps)}",
        "",
        "| contender | op | GB/s median [min-max] | CPU s per GB | peak RSS over start, MiB | note |",
        "|---|---|---|---|---|---|",
    ]
    for s in series.values():
        lines.append(f"| {s.name} | {s.kind} | {_fmt(s.gbps)} | {_fmt(s.cpu_per_gb)} | {_fmt(s.rss_mib, 0)} | {s.note} |")
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
    if "--gpu" in args_in:  # the prepared GPU run (fastpersist.cli.gpu_check), with its own options
        from fastpersist.cli import gpu_check

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
    from fastpersist.cli._progress import wanted

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
