"""The durable tier in S3: fastpersist's drain and restore vs the raw clients, in one run.

A SeaweedFS server (``weed mini``, data on the disk under --dir, loopback; started and removed by
the benchmark, as the tests start it: tests/s3servers.py) holds every object. The state is
GPT-like (``_bench.state.gpt_state``), saved once by a Checkpointer: its files (one data file, a
skeleton and the manifest) are what the raw clients upload and download. The client's side
(the local checkpoint roots, the files downloaded, the fetch's staging directory) lives in
--local-dir (default /dev/shm: the local tier of a training node, NVMe, is far faster than a small
VM's disk, which would bound every contender alike). Before each contender the page cache is
written back (sync: nothing the previous one left dirty is flushed during the next); the
server's copy of what the downloads read stays in its page cache (read once before the rounds).
The contenders of a round run in turn, the order reversed every other round.

Upload (the same files, each contender into its own prefix):

- ``fastpersist drain``: a Checkpointer with ``durable=s3://...`` saves the state (sync), and the
  time runs from the drain's first upload to ``handle.durable.result()``: the local files read
  and their checksums checked, the multipart upload (PART_BYTES parts, 4 in flight), every file
  read back and checked, the manifest put create-if-absent. Its phases are timed through a
  subclass of the store (upload = ``put_file`` calls, read-back = ``chunks`` until consumed). By
  default the drain thread runs nice'd (IOConfig ``drain_nice``, 10); ``nice 0`` is the same
  drain with ``drain_nice=0`` (where IOConfig has no such field, the nice'ing patched out), which
  tells what the priority costs on a busy machine;
- ``fastpersist S3Store.put_file``: the store's upload alone (same chunking, no checksums);
- ``obstore.put``: the raw client, from the file's path, at fastpersist's settings (8 MiB parts,
  4 in flight: the baseline of the ratios), at its defaults, and at two other settings;
- ``boto3 upload_file`` (TransferConfig defaults), ``s3fs put`` (defaults);
- ``DCP FsspecWriter``: ``torch.distributed.checkpoint.save`` of the same state to ``s3://`` through
  s3fs (one process; from memory, so it also serializes the state).

Download (the checkpoint drained at setup; raw clients write files and fsync them):

- ``fastpersist.open(url).load``: fetch into a temporary directory + load (every checksum
  checked) + remove it; ``DurableView.fetch``: the download alone; ``fastpersist.open(local
  root).load``: the same checkpoint from --local-dir, and saved on the disk under --dir (its
  pages dropped first: cold);
- ``obstore get``: one streamed GET per object (the baseline of the ratios); ``obstore
  get_range``: 8 MiB ranged GETs, 8 in flight over the file; ``boto3 download_file``
  (defaults); ``s3fs get``; ``DCP FsspecReader``: ``dcp.load`` into a preallocated state.

GB/s is the state's tensor bytes over the seconds for every contender (the files hold 0.01%
more). CPU is this process's (all threads; for s3fs and DCP, their worker process's), and the
server's, per GB. s3fs and DCP run in a worker process (``--worker``), because s3fs's
aiobotocore pins a botocore that boto3 may not accept: install it apart with
``pip install --target DIR s3fs`` and pass ``--s3fs-site DIR`` (only that process sees DIR).

    python benchmarks/bench_durable.py [--gib 0.5] [--rounds 3] [--dir /tmp] [--s3fs-site DIR]
                                       [--parts upload,download]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from _bench.measure import GB, MiB, device_summary, filesystem, machine_facts
from _bench.state import gpt_state, tensor_bytes
from _bench.stats import median_spread

import fastpersist as fp
from fastpersist.storage import catalog
from fastpersist.checkpointer import Checkpointer
from fastpersist.config import IOConfig, get_config
from fastpersist.tiers.durable import drain as drain_module
from fastpersist.tiers.durable import view as view_module
from fastpersist.tiers.durable.store import PART_BYTES, S3Store

TESTS = Path(__file__).resolve().parent.parent / "tests"
STEP = 0
UPLOAD_BASE = "obstore.put 8 MiB x4"
DOWNLOAD_BASE = "obstore get"
HAS_DRAIN_NICE = "drain_nice" in {f.name for f in dataclasses.fields(IOConfig)}
DRAIN_NICE = int(getattr(get_config(), "drain_nice", 10))  # the drain thread's niceness by default


# ---------------------------------------------------------------------------------------------
# measuring


@dataclass
class Run:
    seconds: float
    cpu: float  # client CPU seconds (this process, or the worker's)
    server_cpu: float  # the S3 server's CPU seconds
    phases: dict[str, float] = field(default_factory=dict)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _proc_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) of process ``pid`` so far; 0 without one."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Meter:
    """Wall, client CPU and server CPU between start() and stop()."""

    def __init__(self, server_pid: int | None) -> None:
        self.pid = server_pid
        self.t0 = self.c0 = self.s0 = 0.0

    def start(self) -> None:
        self.s0, self.c0, self.t0 = _proc_cpu(self.pid), _cpu(), time.perf_counter()

    def stop(self, t_start: float | None = None) -> Run:
        t1, c1, s1 = time.perf_counter(), _cpu(), _proc_cpu(self.pid)
        return Run(t1 - (self.t0 if t_start is None else t_start), c1 - self.c0, s1 - self.s0)


def _settle(cold: list[str] | None = None) -> None:
    """Write back what is dirty (the previous contender's uploads, in the server's page cache);
    the files ``cold`` leave the page cache."""
    os.sync()
    for path in cold or []:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _timed(pid: int | None, fn: Callable[[], object], cold: list[str] | None = None) -> Run:
    _settle(cold)
    m = Meter(pid)
    m.start()
    fn()
    return m.stop()


class TimedS3Store(S3Store):
    """fastpersist's S3 store, with the time spent in uploads and in read-backs recorded."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.first: float | None = None  # when the first upload began (the drain's start)
        self.puts: list[float] = []
        self.reads: list[float] = []

    def put_file(self, key: str, chunks: Iterator[bytes], size: int) -> None:
        t0 = time.perf_counter()
        if self.first is None:
            self.first = t0
        try:
            super().put_file(key, chunks, size)
        finally:
            self.puts.append(time.perf_counter() - t0)

    def chunks(self, key: str, size: int) -> Iterator[memoryview]:
        t0 = time.perf_counter()  # to the last piece consumed: the GETs and the drain's checks
        yield from super().chunks(key, size)
        self.reads.append(time.perf_counter() - t0)


def _drain_config(nice: bool) -> IOConfig | None:
    """The Checkpointer's I/O settings: the default (its drain thread nice'd), or the drain at
    this thread's priority (``drain_nice=0``)."""
    if nice or not HAS_DRAIN_NICE:
        return None
    changes: dict[str, Any] = {"drain_nice": 0}  # a field other sources may lack: not checked statically
    return dataclasses.replace(get_config(), **changes)


@contextlib.contextmanager
def _drain_priority(nice: bool) -> Iterator[None]:
    """Where IOConfig has no ``drain_nice``: with ``nice=False``, drain threads created meanwhile
    keep this thread's priority (the nice'ing patched out)."""
    original = drain_module._lower_priority
    if not nice and not HAS_DRAIN_NICE:
        setattr(drain_module, "_lower_priority", lambda *args: None)
    try:
        yield
    finally:
        setattr(drain_module, "_lower_priority", original)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _fsync_files(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---------------------------------------------------------------------------------------------
# the server and the files


def _servers() -> Any:
    """tests/s3servers.py (the tests' real S3 servers), imported from the tests directory."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    return importlib.import_module("s3servers")


@dataclass
class Setup:
    args: argparse.Namespace
    server: Any
    bucket: str
    work: str  # on the disk (--dir): the server's data, the disk copy of the checkpoint
    local: str  # --local-dir: the local roots, downloads, the fetch's staging
    state: dict[str, Any]
    nbytes: int  # the state's tensor bytes
    src_root: str  # the local checkpoint the raw clients upload
    disk_root: str  # the same state saved on the disk
    files: list[tuple[str, str]]  # (local path, key under a prefix) of its files
    objects: list[tuple[str, int]]  # (key, size) of the drained copy the downloads read (prefix "restore")
    worker_env: dict[str, str]
    worker_why: str | None  # why s3fs (and DCP through it) cannot run in the worker; None: it can

    @property
    def pid(self) -> int | None:
        return int(self.server.pid) if self.server.pid is not None else None

    def url(self, prefix: str) -> str:
        return f"s3://{self.bucket}/{prefix}"


def _checkpoint_files(root: str) -> list[tuple[str, str]]:
    """The files of the checkpoint at STEP under ``root``, the manifest last: (path, key)."""
    d = os.path.join(root, catalog.step_dir(STEP))
    names = sorted(os.listdir(d), key=lambda n: (n == "manifest.json", -os.path.getsize(os.path.join(d, n))))
    return [(os.path.join(d, n), f"{catalog.step_dir(STEP)}/{n}") for n in names]


def _worker(setup: Setup, job: dict[str, Any]) -> Run:
    """Run one s3fs/DCP measurement in a worker process; its own timing comes back."""
    if setup.worker_why is not None:
        raise RuntimeError(setup.worker_why)
    job = {**job, "bucket": setup.bucket, "server_pid": setup.pid, "gib": setup.args.gib}
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(job)],
                          env=setup.worker_env, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"worker {job['op']} failed: {tail[:300]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Run(out["seconds"], out["cpu"], out["server_cpu"])


# ---------------------------------------------------------------------------------------------
# uploads


def _drain(setup: Setup, name: str, nice: bool) -> Run:
    base = os.path.join(setup.local, f"drain-{name}")
    store = TimedS3Store(setup.url(name))
    with _drain_priority(nice):
        ck = Checkpointer([base], mode="sync", durable=store, config=_drain_config(nice))
    try:
        _settle()
        m = Meter(setup.pid)
        handle = ck.save(STEP, setup.state)
        handle.wait()
        m.start()  # the CPU from here: the drain, and this thread waiting for it
        if handle.durable.result() is not True:
            raise RuntimeError(f"{name}: the checkpoint was not drained")
        run = m.stop(t_start=store.first)
    finally:
        ck.close()
        shutil.rmtree(base, ignore_errors=True)
    upload, readback = sum(store.puts), sum(store.reads)
    run.phases = {"upload": upload, "readback": readback, "rest": run.seconds - upload - readback}
    return run


def _store_put(setup: Setup, prefix: str) -> Run:
    store = S3Store(setup.url(prefix))

    def chunks(path: str, size: int) -> Iterator[bytes]:
        fd = os.open(path, os.O_RDONLY)
        try:
            pos = 0
            while pos < size:
                data = os.pread(fd, min(PART_BYTES, size - pos), pos)
                pos += len(data)
                yield data
        finally:
            os.close(fd)

    def run() -> None:
        for path, key in setup.files:
            size = os.path.getsize(path)
            store.put_file(key, chunks(path, size), size)

    return _timed(setup.pid, run)


def _obstore_put(setup: Setup, prefix: str, chunk: int | None, concurrency: int | None) -> Run:
    import obstore

    store = setup.server.store(setup.bucket, prefix)
    kwargs: dict[str, Any] = {}
    if chunk is not None:
        kwargs["chunk_size"] = chunk
    if concurrency is not None:
        kwargs["max_concurrency"] = concurrency

    def run() -> None:
        for path, key in setup.files:
            obstore.put(store, key, Path(path), **kwargs)

    return _timed(setup.pid, run)


def _boto3_put(setup: Setup, prefix: str) -> Run:
    client = setup.server.client()

    def run() -> None:
        for path, key in setup.files:
            client.upload_file(path, setup.bucket, f"{prefix}/{key}")

    return _timed(setup.pid, run)


def upload_contenders(setup: Setup) -> list[tuple[str, str, Callable[[int], Run]]]:
    """(name, settings, run(round)) of every upload contender."""
    part = f"{PART_BYTES // MiB} MiB parts, 4 in flight"
    out: list[tuple[str, str, Callable[[int], Run]]] = [
        (f"fastpersist drain (nice {DRAIN_NICE}, default)", f"{part}; + read-back",
         lambda i: _drain(setup, f"drain-default-r{i}", True)),
        ("fastpersist drain (nice 0)", f"{part}; + read-back; drain_nice=0",
         lambda i: _drain(setup, f"drain-nice0-r{i}", False)),
        ("fastpersist S3Store.put_file", f"{part}; upload only",
         lambda i: _store_put(setup, f"storeput-r{i}")),
        (UPLOAD_BASE, "8 MiB parts, 4 in flight", lambda i: _obstore_put(setup, f"ob8x4-r{i}", 8 * MiB, 4)),
        ("obstore.put defaults", "5 MiB parts, 12 in flight", lambda i: _obstore_put(setup, f"obdef-r{i}", None, None)),
        ("obstore.put 8 MiB x8", "8 MiB parts, 8 in flight", lambda i: _obstore_put(setup, f"ob8x8-r{i}", 8 * MiB, 8)),
        ("obstore.put 16 MiB x4", "16 MiB parts, 4 in flight",
         lambda i: _obstore_put(setup, f"ob16x4-r{i}", 16 * MiB, 4)),
        ("boto3 upload_file", "TransferConfig defaults (8 MB parts, 10 threads)",
         lambda i: _boto3_put(setup, f"boto3-r{i}")),
        ("s3fs put", "defaults", lambda i: _worker(setup, {"op": "s3fs_put", "prefix": f"s3fs-r{i}",
                                                              "files": setup.files})),
        ("DCP FsspecWriter (s3fs)", "defaults (1 thread); serializes the state too",
         lambda i: _worker(setup, {"op": "dcp_save", "prefix": f"dcp-r{i}"})),
    ]
    return out


# ---------------------------------------------------------------------------------------------
# downloads


def _fp_load(setup: Setup, where: str, check: bool, cold: bool = False) -> Run:
    # fastpersist.open(url) is a DurableView staging in the system's temporary directory: here
    # in --local-dir, as the raw clients' downloads
    view = view_module.DurableView(where, staging=setup.local) if "://" in where else fp.open(where)
    d = os.path.join(where, catalog.step_dir(STEP))
    files = [os.path.join(d, n) for n in os.listdir(d)] if cold else None
    out: list[Any] = []
    run = _timed(setup.pid, lambda: out.append(view.load(STEP)), files)
    if check and not _same(setup.state, out[0]):
        raise RuntimeError(f"{where}: the loaded state differs from the saved one")
    return run


def _fp_fetch(setup: Setup, url: str) -> Run:
    view = view_module.DurableView(url, staging=setup.local)
    top = tempfile.mkdtemp(prefix="fetch-", dir=setup.local)
    try:
        return _timed(setup.pid, lambda: view.fetch(STEP, top))
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _obstore_get(setup: Setup, prefix: str, ranged: bool) -> Run:
    import obstore

    store = setup.server.store(setup.bucket, prefix)
    top = tempfile.mkdtemp(prefix="get-", dir=setup.local)
    objects = setup.objects
    paths = [os.path.join(top, key.replace("/", "_")) for key, _ in objects]

    def whole(item: tuple[tuple[str, int], str]) -> None:
        (key, _), path = item
        with open(path, "wb") as f:
            for chunk in obstore.get(store, key).stream(min_chunk_size=8 * MiB):
                f.write(chunk)
            os.fsync(f.fileno())

    def run_whole() -> None:
        with ThreadPoolExecutor(8) as ex:
            list(ex.map(whole, zip(objects, paths)))

    def run_ranged() -> None:
        fds = [os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths]
        pieces = [(fd, key, off, min(8 * MiB, size - off)) for fd, (key, size) in zip(fds, objects)
                  for off in range(0, max(size, 1), 8 * MiB)]

        def one(piece: tuple[int, str, int, int]) -> None:
            fd, key, off, n = piece
            view = memoryview(obstore.get_range(store, key, start=off, length=n))
            while view:
                w = os.pwrite(fd, view, off)
                view, off = view[w:], off + w

        try:
            with ThreadPoolExecutor(8) as ex:
                list(ex.map(one, pieces))
            for fd in fds:
                os.fsync(fd)
        finally:
            for fd in fds:
                os.close(fd)

    try:
        run = _timed(setup.pid, run_ranged if ranged else run_whole)
        for (key, size), p in zip(objects, paths):
            if os.path.getsize(p) != size:
                raise RuntimeError(f"{key}: {os.path.getsize(p)} bytes downloaded, {size} expected")
        return run
    finally:
        shutil.rmtree(top, ignore_errors=True)


def _boto3_get(setup: Setup, prefix: str) -> Run:
    client = setup.server.client()
    top = tempfile.mkdtemp(prefix="boto3-", dir=setup.local)
    objects = setup.objects
    paths = [os.path.join(top, key.replace("/", "_")) for key, _ in objects]

    def run() -> None:
        for (key, _), path in zip(objects, paths):
            client.download_file(setup.bucket, f"{prefix}/{key}", path)
        _fsync_files(paths)

    try:
        return _timed(setup.pid, run)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def download_contenders(setup: Setup, prefix: str, dcp_prefix: str | None
                        ) -> list[tuple[str, str, Callable[[int], Run]]]:
    url = setup.url(prefix)
    out: list[tuple[str, str, Callable[[int], Run]]] = [
        ("fastpersist.open(s3).load", f"fetch: {view_module.FETCH_THREADS} threads over files, "
                                      f"{PART_BYTES // MiB} MiB ranged GETs; + load, verified",
         lambda i: _fp_load(setup, url, i == 0)),
        ("fastpersist DurableView.fetch", "the download alone (files fsync'd)", lambda i: _fp_fetch(setup, url)),
        ("fastpersist.open(local).load", "the same checkpoint in --local-dir",
         lambda i: _fp_load(setup, setup.src_root, i == 0)),
        ("fastpersist.open(disk).load", "the same state saved on the disk, cold",
         lambda i: _fp_load(setup, setup.disk_root, i == 0, cold=True)),
        (DOWNLOAD_BASE, "one streamed GET per object, 8 objects at once",
         lambda i: _obstore_get(setup, prefix, False)),
        ("obstore get_range", "8 MiB ranged GETs, 8 in flight", lambda i: _obstore_get(setup, prefix, True)),
        ("boto3 download_file", "TransferConfig defaults (8 MB ranges, 10 threads)",
         lambda i: _boto3_get(setup, prefix)),
        ("s3fs get", "defaults", lambda i: _worker(setup, {"op": "s3fs_get", "prefix": prefix,
                                                              "objects": setup.objects, "dir": setup.local})),
    ]
    if dcp_prefix is not None:
        out.append(("DCP FsspecReader (s3fs)", "dcp.load into a preallocated state",
                    lambda i: _worker(setup, {"op": "dcp_load", "prefix": dcp_prefix, "check": i == 0})))
    return out


# ---------------------------------------------------------------------------------------------
# rounds and tables


def run_rounds(setup: Setup, contenders: list[tuple[str, str, Callable[[int], Run]]]
               ) -> tuple[dict[str, list[Run]], dict[str, str]]:
    """Every contender once per round (the order reversed every other round); a contender that
    fails is left out of the later rounds, its error kept."""
    runs: dict[str, list[Run]] = {name: [] for name, _, _ in contenders}
    failed: dict[str, str] = {}
    for i in range(setup.args.rounds):
        order = contenders if i % 2 == 0 else list(reversed(contenders))
        for name, _, fn in order:
            if name in failed:
                continue
            try:
                r = fn(i)
            except Exception as e:  # noqa: BLE001 - reported in the table
                failed[name] = f"{type(e).__name__}: {e}"
                print(f"  ! {name}: {failed[name]}", file=sys.stderr, flush=True)
                continue
            runs[name].append(r)
            print(f"  round {i}: {name}: {r.seconds:.2f} s", file=sys.stderr, flush=True)
    return runs, failed


def _gbps(setup: Setup, runs: list[Run]) -> list[float]:
    return [setup.nbytes / r.seconds / GB for r in runs]


def table(setup: Setup, contenders: list[tuple[str, str, Callable[[int], Run]]], runs: dict[str, list[Run]],
          failed: dict[str, str], base: str) -> None:
    gb = setup.nbytes / GB
    base_gbps = statistics.median(_gbps(setup, runs[base])) if runs.get(base) else float("nan")
    print(f"| contender | settings | seconds | GB/s | vs {base} | client CPU s/GB | server CPU s/GB |")
    print("|---|---|---|---|---|---|---|")
    for name, settings, _ in contenders:
        rs = runs[name]
        if not rs:
            print(f"| {name} | {settings} | did not run: {failed.get(name, '?')[:200]} | - | - | - | - |")
            continue
        g = _gbps(setup, rs)
        print(f"| {name} | {settings} | {median_spread([r.seconds for r in rs])} | {median_spread(g)} | "
              f"{statistics.median(g) / base_gbps:.2f} | {median_spread([r.cpu / gb for r in rs])} | "
              f"{median_spread([r.server_cpu / gb for r in rs])} |")


def part_upload(setup: Setup) -> str | None:
    contenders = upload_contenders(setup)
    runs, failed = run_rounds(setup, contenders)
    print(f"\n## Upload to S3 (SeaweedFS on loopback; {setup.nbytes / GB:.3f} GB state, {len(setup.files)} files; "
          f"{setup.args.rounds} rounds, median [min-max]; the files in --local-dir)\n")
    table(setup, contenders, runs, failed, UPLOAD_BASE)
    gb = setup.nbytes / GB
    print("\n### The drain's phases (seconds, median [min-max]; upload = put_file, which reads and checks the local "
          "file as it sends it; read-back = the ranged GETs and their checks; rest = manifest, listing, retention)\n")
    print("| drain | total | upload | upload GB/s | read-back + verify | read-back GB/s | rest |")
    print("|---|---|---|---|---|---|---|")
    for name, _, _ in contenders[:2]:
        rs = runs[name]
        if not rs:
            print(f"| {name} | did not run: {failed.get(name, '?')[:200]} | | | | | |")
            continue
        print(f"| {name} | {median_spread([r.seconds for r in rs])} | {median_spread([r.phases['upload'] for r in rs])} "
              f"| {median_spread([gb / r.phases['upload'] for r in rs])} | "
              f"{median_spread([r.phases['readback'] for r in rs])} | "
              f"{median_spread([gb / r.phases['readback'] for r in rs])} | "
              f"{median_spread([r.phases['rest'] for r in rs], 3)} |")
    base, nice0 = runs.get(UPLOAD_BASE), runs.get(contenders[1][0])
    if base and nice0:
        b = statistics.median(_gbps(setup, base))
        up = statistics.median(gb / r.phases["upload"] for r in nice0)
        print(f"\ndrain (nice 0) end to end / {UPLOAD_BASE}: {statistics.median(_gbps(setup, nice0)) / b:.2f}; "
              f"its upload phase alone / {UPLOAD_BASE}: {up / b:.2f}")
    dcp = runs.get("DCP FsspecWriter (s3fs)")
    return f"dcp-r{setup.args.rounds - 1}" if dcp and len(dcp) == setup.args.rounds else None


def part_download(setup: Setup, dcp_prefix: str | None) -> None:
    contenders = download_contenders(setup, "restore", dcp_prefix)
    runs, failed = run_rounds(setup, contenders)
    print(f"\n## Download / restore from S3 ({setup.nbytes / GB:.3f} GB state, {len(setup.files)} objects; "
          f"{setup.args.rounds} rounds, median [min-max]; the server's copy in its page cache; files "
          f"written to --local-dir and fsync'd)\n")
    table(setup, contenders, runs, failed, DOWNLOAD_BASE)
    if dcp_prefix is None:
        print("\nDCP FsspecReader: not run (the DCP upload did not run in every round)")
    s3 = runs.get("fastpersist.open(s3).load")
    for name, what in (("fastpersist.open(local).load", "--local-dir"), ("fastpersist.open(disk).load", "the disk")):
        local = runs.get(name)
        if s3 and local:
            print(f"\nrestore from S3 / from {what} (time): "
                  f"{statistics.median(r.seconds for r in s3) / statistics.median(r.seconds for r in local):.2f}x", end="")
    print()
    fetch = runs.get("fastpersist DurableView.fetch")
    if s3 and fetch:
        print(f"fetch share of the restore from S3: "
              f"{statistics.median(r.seconds for r in fetch) / statistics.median(r.seconds for r in s3):.2f}")


# ---------------------------------------------------------------------------------------------
# the worker process (s3fs and DCP)


def _s3fs_options() -> dict[str, Any]:
    return {"key": os.environ["AWS_ACCESS_KEY_ID"], "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
            "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "region_name": os.environ["AWS_REGION"]}}


def worker_main(job: dict[str, Any]) -> int:
    import warnings

    import s3fs  # type: ignore[import-untyped, import-not-found, unused-ignore]

    from _bench.savers import dcp_single_process

    opts = _s3fs_options()
    fs = s3fs.S3FileSystem(**opts)
    fs.ls(job["bucket"])  # the connection made, outside the timing
    bucket, prefix, op = job["bucket"], job["prefix"], job["op"]
    url = f"s3://{bucket}/{prefix}"
    state: Any = None
    top = None
    if op in ("dcp_save", "dcp_load"):
        state = gpt_state(job["gib"], seed=1 if op == "dcp_save" else 2)
    if op == "s3fs_get":
        top = tempfile.mkdtemp(prefix="s3fs-", dir=job["dir"])
    _settle()
    s0, c0, t0 = _proc_cpu(job["server_pid"]), _cpu(), time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if op == "s3fs_put":
            for path, key in job["files"]:
                fs.put_file(path, f"{bucket}/{prefix}/{key}")
        elif op == "s3fs_get":
            assert top is not None
            paths = []
            for key, _ in job["objects"]:
                paths.append(os.path.join(top, key.replace("/", "_")))
                fs.get_file(f"{bucket}/{prefix}/{key}", paths[-1])
            _fsync_files(paths)
        elif op == "dcp_save":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            dcp.save(state, storage_writer=FsspecWriter(url, **opts), **dcp_single_process(dcp.save))
        elif op == "dcp_load":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            dcp.load(state, storage_reader=FsspecReader(url, **opts), **dcp_single_process(dcp.load))
        else:
            raise ValueError(f"unknown worker op {op!r}")
    t1, c1, s1 = time.perf_counter(), _cpu(), _proc_cpu(job["server_pid"])
    if top is not None:
        for key, size in job["objects"]:
            got = os.path.getsize(os.path.join(top, key.replace("/", "_")))
            if got != size:
                raise RuntimeError(f"{key}: {got} bytes downloaded, {size} expected")
        shutil.rmtree(top, ignore_errors=True)
    if op == "dcp_load" and job.get("check") and not _same(gpt_state(job["gib"], seed=1), state):
        raise RuntimeError("DCP loaded a state that differs from the saved one")
    print(json.dumps({"seconds": t1 - t0, "cpu": c1 - c0, "server_cpu": s1 - s0}))
    return 0


def _worker_setup(args: argparse.Namespace, server_env: dict[str, str]) -> tuple[dict[str, str], str | None]:
    """The worker's environment, and why s3fs cannot run there (None: it can)."""
    env = {**os.environ, **server_env}
    if args.s3fs_site:
        env["PYTHONPATH"] = os.pathsep.join([os.path.abspath(args.s3fs_site)] + ([env["PYTHONPATH"]]
                                                                                 if env.get("PYTHONPATH") else []))
    probe = subprocess.run([sys.executable, "-c", "import s3fs, botocore; print(s3fs.__version__, botocore.__version__)"],
                           env=env, capture_output=True, text=True)
    if probe.returncode != 0:
        return env, "s3fs is not installed (pip install --target DIR s3fs; --s3fs-site DIR)"
    env["FP_BENCH_S3FS"] = probe.stdout.strip()
    return env, None


# ---------------------------------------------------------------------------------------------


def _versions(setup: Setup) -> str:
    from importlib.metadata import version

    weed = subprocess.run([_servers().weed_binary() or "weed", "version"], capture_output=True, text=True).stdout
    s3fs = setup.worker_env.get("FP_BENCH_S3FS", "not installed").split()
    return (f"obstore {version('obstore')}, boto3 {version('boto3')}, "
            f"s3fs {' / botocore '.join(s3fs)} (worker process), SeaweedFS {' '.join(weed.split()[1:3])}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=0.5, help="state size in GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk: the server's data")
    p.add_argument("--local-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                   help="the client's side: local checkpoint roots, downloads (default /dev/shm, else --dir)")
    p.add_argument("--s3fs-site", default=None, help="a directory s3fs was installed into (pip install --target)")
    p.add_argument("--parts", default="upload,download")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return worker_main(json.loads(args.worker))

    servers = _servers()
    reason = servers.skip_reason("seaweedfs")
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 1
    need = int(args.gib * 2**30 * (10 * args.rounds + 4) * 1.2)  # every upload is kept on the server
    if shutil.disk_usage(args.dir).free < need:
        print(f"cannot run: {args.dir} needs about {need / GB:.1f} GB free", file=sys.stderr)
        return 1
    if shutil.disk_usage(args.local_dir or args.dir).free < 4 * args.gib * 2**30:
        print(f"cannot run: {args.local_dir} needs about {4 * args.gib * 2**30 / GB:.1f} GB free", file=sys.stderr)
        return 1
    work = tempfile.mkdtemp(prefix="fp-bench-durable-", dir=args.dir)
    local_dir = tempfile.mkdtemp(prefix="fp-bench-durable-", dir=args.local_dir or args.dir)
    server = None
    saved_env = dict(os.environ)
    try:
        server = servers.start_seaweedfs(os.path.join(work, "seaweedfs"))
        os.environ.update(server.env())  # fastpersist's S3Store reads the endpoint and keys from there
        bucket = server.new_bucket("bench-durable")
        import obstore

        # obstore's runtime threads are made by the first call: here, at this thread's priority
        # (made by the nice'd drain thread, they would all inherit its nice 10)
        obstore.list(server.store(bucket)).collect()
        state = gpt_state(args.gib, seed=1)
        nbytes = tensor_bytes(state)
        src_root, disk_root = os.path.join(local_dir, "local"), os.path.join(work, "disk")
        # the setup saves: the local checkpoint (what the raw clients upload, and the local
        # load reads) and its drained copy in s3://bucket/restore (what the downloads read);
        # the same state on the disk
        ck = Checkpointer([src_root], mode="sync", durable=f"s3://{bucket}/restore")
        handle = ck.save(STEP, state)
        handle.wait()
        handle.durable.result()
        ck.close()
        ck = Checkpointer([disk_root], mode="sync")
        ck.save(STEP, state).wait()
        ck.close()
        restore = server.store(bucket, "restore")
        drained = [(str(m["path"]).removeprefix("restore/"), int(m["size"]))  # keys under the store's prefix
                   for m in obstore.list(restore).collect()]
        drained.sort(key=lambda o: -o[1])
        for key, _ in drained:  # into the server's page cache
            obstore.get(restore, key).bytes()
        worker_env, why = _worker_setup(args, server.env())
        setup = Setup(args, server, bucket, work, local_dir, state, nbytes, src_root, disk_root,
                      _checkpoint_files(src_root), drained, worker_env, why)
        sizes = ", ".join(f"{os.path.basename(path)} {os.path.getsize(path) / MiB:.2f} MiB" for path, _ in setup.files)
        print(f"# fastpersist durable tier (S3) benchmark: python {sys.version.split()[0]}, {platform.node()}")
        print(f"\n{machine_facts(work)}; load average at start {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
        print(f"{device_summary(work, min(nbytes, 512 * MiB))}")
        print(f"--local-dir {args.local_dir or args.dir} on {filesystem(local_dir)}")
        print(f"server: SeaweedFS `weed mini`, data under --dir, loopback; clients: {_versions(setup)}")
        print(f"state: {nbytes / GB:.3f} GB ({nbytes / 2**30:.3f} GiB) of tensors; checkpoint files: {sizes}")
        print(f"fastpersist store: PART_BYTES {PART_BYTES // MiB} MiB, 4 parts in flight per file, one file at a "
              f"time, one drain thread; fetch: {view_module.FETCH_THREADS} threads over files, "
              f"{PART_BYTES // MiB} MiB ranged GETs one after another within a file")
        if why:
            print(f"s3fs and DCP: {why}")
        dcp_prefix = None
        parts = args.parts.split(",")
        if "upload" in parts:
            dcp_prefix = part_upload(setup)
        if "download" in parts:
            part_download(setup, dcp_prefix)
        print(f"\nload average at the end {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    finally:
        if server is not None:
            server.close()
        os.environ.clear()
        os.environ.update(saved_env)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(local_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
