"""The file operations fastpersist performs, behind one small seam.

The Checkpointer takes a :class:`FileBackend` as a constructor argument. The default one does
real I/O; tests and benchmarks pass subclasses that fail a chosen operation or throttle writes
per root (a token bucket), so the whole save protocol, retention, start-up cleanup and the
root lock run against real files with the fault or the bandwidth limit exactly where they want
it. Backends see paths and byte counts, never tensors.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
from collections.abc import Callable

from fastpersist.errors import CheckpointReadError
from fastpersist.io.files import DirectFile, fsync_dir, read_small_file


# Points of the save protocol where :meth:`FileBackend.event` is called, in order. A crash test
# kills the process at one of them; see fastpersist.storage.faults.
PROTOCOL_POINTS = (
    "after-data",  # this rank's data files and their directories are fsync'd
    "after-manifest-temp",  # coordinator: the manifest is written and fsync'd under a temp name
    "after-rename",  # coordinator: renamed to manifest.json (the commit), directory not yet fsync'd
    "before-latest",  # coordinator: the commit is durable; `latest` not yet updated
    "after-latest",  # coordinator: `latest` names the new checkpoint
)


class FileBackend:
    """Real files. ``root`` is the index of the checkpoint root a path belongs to."""

    # Hooks a subclass may override (to delay, fail or count); they see paths, never data.

    def before_open(self, root: int, path: str) -> None:
        """Called before a file of the checkpoint is created."""

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        """Called (by a writer thread) before each write request."""

    def before_fsync(self, path: str) -> None:
        """Called before a file is fsync'd."""

    def before_rename(self, dst: str) -> None:
        """Called before a file is renamed to ``dst`` (an atomic commit)."""

    def event(self, point: str) -> None:
        """Called at each point of :data:`PROTOCOL_POINTS` as the save passes it."""

    def before_delete(self, path: str) -> None:
        """Called before a file or directory is deleted (retention, cleanup, a failed save)."""

    def before_list(self, path: str) -> None:
        """Called before a directory is listed."""

    def before_lock(self, path: str) -> None:
        """Called before the root lock is taken."""

    def before_link(self, root: int, src: str, dst: str) -> None:
        pass

    def before_read(self, path: str, offset: int | None, nbytes: int | None) -> None:
        """Called before a checkpoint file is opened for reading (offset None) and before each
        read request (by reader threads)."""

    # The operations.

    def open(self, path: str, flags: int, direct: str, root: int) -> DirectFile:
        self.before_open(root, path)
        file = DirectFile(path, flags, direct)
        file.on_write = lambda offset, nbytes: self.before_write(root, path, offset, nbytes)
        return file

    def open_read(self, path: str, direct: str, *, follow: bool = False) -> DirectFile:
        """Open a checkpoint file for reading (a regular file; a link only if ``follow``)."""
        self._hook_read(path)
        file = DirectFile.open_for_read(path, direct, follow=follow)
        file.on_read = lambda offset, nbytes: self.before_read(path, offset, nbytes)
        return file

    def read_small(self, path: str, limit: int, what: str, *, follow: bool = False) -> bytes:
        """The whole of a small file (a manifest, ``latest``), at most ``limit`` bytes."""
        self._hook_read(path)
        return read_small_file(path, limit, what, follow=follow)

    def _hook_read(self, path: str) -> None:
        try:
            self.before_read(path, None, None)
        except OSError as e:
            raise CheckpointReadError(f"cannot open {path}: {e.strerror or e}") from e

    def fsync(self, file: DirectFile) -> None:
        self.before_fsync(file.path)
        os.fsync(file.fd)

    def write_small(self, path: str, data: bytes, root: int) -> None:
        """Create ``path`` (which must not exist) with ``data``, fsync'd."""
        self.before_open(root, path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            self.before_write(root, path, 0, len(data))
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            self.before_fsync(path)
            os.fsync(fd)
        finally:
            os.close(fd)

    def link(self, root: int, src: str, dst: str) -> None:
        """Give the regular file ``src`` the new name ``dst`` (a hard link, same filesystem;
        ``dst`` must not exist). A ``src`` that is a symbolic link is refused, never followed."""
        self.before_link(root, src, dst)
        os.link(src, dst, follow_symlinks=False)

    def replace(self, src: str, dst: str) -> None:
        self.before_rename(dst)
        os.replace(src, dst)

    def fsync_dir(self, path: str) -> None:
        self.before_fsync(path)
        fsync_dir(path)

    def exists(self, path: str) -> bool:
        """Whether ``path`` names anything (a link is not followed): a query, never failed by a
        fault backend unless it chooses to."""
        return os.path.lexists(path)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)

    def listdir(self, path: str) -> list[str]:
        self.before_list(path)
        return os.listdir(path)

    def unlink(self, path: str) -> None:
        self.before_delete(path)
        os.unlink(path)

    def rmdir(self, path: str) -> None:
        self.before_delete(path)
        os.rmdir(path)

    def rmtree(self, path: str, onerror: Callable[[str, OSError], None]) -> None:
        """Delete a directory tree; ``onerror(path, error)`` hears each failure (best effort)."""
        def report(_func: object, p: str, exc: BaseException) -> None:
            if isinstance(exc, OSError):
                onerror(p, exc)
            else:  # pragma: no cover - shutil passes OSErrors only
                raise exc

        self.before_delete(path)
        if _HAS_ONEXC:
            shutil.rmtree(path, onexc=report)  # type: ignore[call-arg,unused-ignore]
        else:  # Python < 3.12
            shutil.rmtree(path, onerror=lambda f, p, ei: report(f, p, ei[1]))

    def lock(self, path: str) -> int:
        """Open ``path`` (created if absent) and take an exclusive, non-blocking flock on it;
        returns the descriptor. Raises BlockingIOError when another process holds it."""
        self.before_lock(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            os.close(fd)
            raise
        return fd


_HAS_ONEXC = sys.version_info >= (3, 12)


REAL_FILES = FileBackend()  # the default: what a caller that passes no backend uses
