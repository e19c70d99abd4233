from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator

import pytest

from fastpersist.config import IOConfig

KiB = 1024


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


def _mount(target: str, options: str, fstype: str = "tmpfs") -> bool:
    r = subprocess.run(["mount", "-t", fstype, "-o", options, fstype, target], capture_output=True)
    return r.returncode == 0


@pytest.fixture
def small_fs(tmp_path) -> Iterator[str]:
    """A real 8 MiB tmpfs: writes past its size fail with ENOSPC."""
    d = str(tmp_path / "small")
    os.makedirs(d)
    if not _mount(d, "size=8m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


@pytest.fixture
def readonly_fs(tmp_path) -> Iterator[str]:
    """A real read-only filesystem (root ignores directory permissions, a ro mount it cannot)."""
    d = str(tmp_path / "ro")
    os.makedirs(d)
    if not _mount(d, "size=1m,ro"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def no_direct_fs(tmp_path) -> Iterator[str]:
    """A real filesystem that refuses O_DIRECT (ramfs answers EINVAL on open)."""
    d = str(tmp_path / "ramfs")
    os.makedirs(d)
    if not _mount(d, "size=64m", "ramfs"):
        pytest.skip("mounting a ramfs needs root")
    try:
        if supports_direct(d):
            pytest.skip("this ramfs accepts O_DIRECT")
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


@pytest.fixture
def remountable_fs(tmp_path) -> Iterator[str]:
    """A real 64 MiB tmpfs that a test can remount read-only (``remount(d, "ro")``)."""
    d = str(tmp_path / "remount")
    os.makedirs(d)
    if not _mount(d, "size=64m"):
        pytest.skip("mounting a tmpfs needs root")
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", d], check=False)


def remount(path: str, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", path], check=True)
