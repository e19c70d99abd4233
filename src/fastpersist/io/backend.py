"""The file operations a sharded save performs, behind one small seam.

The Checkpointer takes a :class:`FileBackend` as a constructor argument. The default one does
real I/O; tests and benchmarks pass subclasses that fail a chosen operation or throttle writes
per root (a token bucket), so the whole save protocol runs against real files with the fault
or the bandwidth limit exactly where they want it. Backends see paths and byte counts, never
tensors.
"""

from __future__ import annotations

import os

from fastpersist.io.files import DirectFile, fsync_dir


class FileBackend:
    """Real files. ``root`` is the index of the checkpoint root a path belongs to."""

    def open(self, path: str, flags: int, direct: str, root: int) -> DirectFile:
        file = DirectFile(path, flags, direct)
        file.on_write = lambda offset, nbytes: self.before_write(root, path, offset, nbytes)
        return file

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        """Called by a writer thread before each write request (may block or raise)."""

    def fsync(self, file: DirectFile) -> None:
        os.fsync(file.fd)

    def write_small(self, path: str, data: bytes, root: int) -> None:
        """Create ``path`` (which must not exist) with ``data``, fsync'd."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            self.before_write(root, path, 0, len(data))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        fsync_dir(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)
