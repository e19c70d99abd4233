from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator

import pytest

from fastpersist.config import IOConfig

KiB = 1024
LONG_TIMEOUT_S = 3600  # a test marked `long` (crash trials, the long fuzz run) may take this long


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` get :data:`LONG_TIMEOUT_S` unless they set their own timeout."""
    for item in items:
        if item.get_closest_marker("long") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


@pytest.fixture
def small_io() -> IOConfig:
    """Tiny chunks and pool, so that small tensors cross chunk and pool boundaries."""
    return IOConfig(
        chunk_bytes=64 * KiB,
        num_buffers=2,
        writer_threads=2,
        reader_threads=3,
        read_chunk_bytes=64 * KiB,
        zero_copy_min_bytes=8 * KiB,
    )


def supports_direct(path: str) -> bool:
    """Whether the filesystem holding ``path`` accepts O_DIRECT."""
    probe = os.path.join(path, ".direct-probe")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:
        return False
    os.close(fd)
    os.unlink(probe)
    return True


@contextlib.contextmanager
def _mounted(tmp_path, name: str, options: str, fstype: str = "tmpfs") -> Iterator[str]:
    """A real filesystem mounted at tmp_path/name for the test (skipped without root)."""
    d = str(tmp_path / name)
    os.makedirs(d)
    r = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, d], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"mounting a {fstype} needs root")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


@pytest.fixture
def small_fs(tmp_path) -> Iterator[str]:
    """A real 8 MiB tmpfs: writes past its size fail with ENOSPC."""
    with _mounted(tmp_path, "small", "size=8m") as d:
        yield d


@pytest.fixture
def readonly_fs(tmp_path) -> Iterator[str]:
    """A real read-only filesystem (root ignores directory permissions, a ro mount it cannot)."""
    with _mounted(tmp_path, "ro", "size=1m,ro") as d:
        yield d


def open_fds() -> set[str]:
    """This process's open descriptors, each as fd number and what it points to (so a
    descriptor another thread opened and closed meanwhile, reusing a number, is told apart)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd} -> {os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:  # closed while listing
            pass
    return out


def fds_under(path: str) -> list[str]:
    """Open descriptors of this process on files under ``path`` (a leak's OS-level symptom;
    unlike a count of all descriptors it ignores what other threads of the suite hold)."""
    real = os.path.realpath(path)
    return [f for f in open_fds() if f.split(" -> ", 1)[-1].startswith(real)]


@pytest.fixture
def no_direct_fs(tmp_path) -> Iterator[str]:
    """A real filesystem that refuses O_DIRECT (ramfs answers EINVAL on open)."""
    with _mounted(tmp_path, "ramfs", "size=64m", "ramfs") as d:
        if supports_direct(d):
            pytest.skip("this ramfs accepts O_DIRECT")
        yield d


@pytest.fixture
def remountable_fs(tmp_path) -> Iterator[str]:
    """A real 64 MiB tmpfs that a test can remount read-only (``remount(d, "ro")``)."""
    with _mounted(tmp_path, "remount", "size=64m") as d:
        yield d


def remount(path: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", path], check=True)
