"""Measuring: wall and CPU time with peak memory, the page cache, the device's own speed, and the
machine's facts for a benchmark's header.

Every speed the benchmarks report is a ratio to something measured in the same run; the device
probe here is that something for the disk (fio O_DIRECT when installed, else a raw O_DIRECT probe).
"""

from __future__ import annotations

import errno
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

GB = 1e9  # the benchmark tables' unit: decimal GB/s, the unit of their recorded baselines
MiB = 1 << 20
GiB = 1 << 30


# ------------------------------------------------------------------------------- timing


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak resident memory of this process above its level at the start, sampled every 5 ms
    (a context manager)."""

    def __init__(self) -> None:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())

    @property
    def delta(self) -> int:
        """Bytes above the start."""
        return self.peak - self.start

    @property
    def mib(self) -> float:
        return self.delta / MiB


@dataclass
class Sample:
    seconds: float
    cpu_seconds: float
    peak_rss_delta: int


def measure(fn: Callable[[], object]) -> tuple[Sample, object]:
    """Wall time, process CPU time (all threads) and peak RSS above the starting RSS."""
    gc.collect()
    with PeakRSS() as rss:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return Sample(dt, cpu, rss.delta), out


# ------------------------------------------------------------------------------- files and caches


def drop_caches() -> bool:
    """Write dirty pages back and drop the page cache; False where that is not permitted."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def remove(*paths: str) -> None:
    """Remove files and directory trees (those that exist)."""
    for p in paths:
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.unlink(p)


# ------------------------------------------------------------------------------- the device


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


# ------------------------------------------------------------------------------- the machine


def filesystem(path: str) -> str:
    """``DEVICE (TYPE)`` of the filesystem holding ``path``, from ``df -T``."""
    fs = subprocess.run(["df", "-T", path], capture_output=True, text=True).stdout.splitlines()[-1].split()
    return f"{fs[0]} ({fs[1]})"


def machine_facts(workdir: str) -> str:
    return (
        f"machine: {os.cpu_count()} cores, {platform.machine()}, Linux {platform.release()}, "
        f"torch {torch.__version__}; workdir {workdir} on {filesystem(workdir)}"
    )
