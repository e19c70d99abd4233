"""The file operations fastpersist performs, behind one small seam.

The Checkpointer takes a :class:`FileBackend` as a constructor argument. The default one does
real I/O; tests and benchmarks pass subclasses that fail a chosen operation or throttle writes
per root (a token bucket), so the whole save protocol, retention, start-up cleanup and the
root lock run against real files with the fault or the bandwidth limit exactly where they want
it. Backends see paths and byte counts, never tensors.

Every operation on a checkpoint's files goes through a method here, and every method calls its
``before_*`` hook first (the seam a subclass overrides): outside ``fastpersist/io`` (the engine
under this seam) and this module, no fastpersist module opens, writes, reads, fsyncs, renames,
links, deletes, lists, creates or stats a checkpoint's file itself
(``tests/unit/storage/test_storage_seam.py`` walks the sources and holds the few exceptions,
each with its reason). ``root`` is the index of the checkpoint root a path belongs to, ``-1``
for a file of no root (a scratch file).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable

from fastpersist.errors import CheckpointReadError
from fastpersist.io.files import DirectFile, fsync_dir, pread_into, pwrite_all, read_small_file


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
        """Called before ``src`` is given the new name ``dst`` (a hard link)."""

    def before_read(self, path: str, offset: int | None, nbytes: int | None) -> None:
        """Called before a checkpoint file is opened for reading (offset None) and before each
        read request (by reader threads)."""

    def before_mkdir(self, path: str) -> None:
        """Called before a directory is created (with its missing parents)."""

    def before_stat(self, path: str) -> None:
        """Called before a query of what ``path`` is (stat, lstat, exists, is_dir)."""

    def before_truncate(self, path: str, size: int) -> None:
        """Called before a file's size is set to ``size`` (a sparse file to fill at offsets)."""

    # The operations.

    def open(self, path: str, flags: int, direct: str, root: int, mode: int = 0o644) -> DirectFile:
        """Open ``path`` for writing (``flags``: os.O_* flags; ``direct``: the O_DIRECT policy,
        see :class:`fastpersist.io.files.DirectFile`). Each write request to the file, from the
        write engine or from :meth:`pwrite`, calls :meth:`before_write` first."""
        self.before_open(root, path)
        file = DirectFile(path, flags, direct, mode)
        file.on_write = lambda offset, nbytes: self.before_write(root, path, offset, nbytes)
        return file

    def pwrite(self, file: DirectFile, data: bytes | bytearray | memoryview, offset: int) -> None:
        """Write all of ``data`` at ``offset`` of ``file`` (opened by :meth:`open`), through its
        buffered descriptor: one write request."""
        view = memoryview(data).cast("B")
        if file.on_write is not None:  # open()'s hook, which knows the file's root
            file.on_write(offset, len(view))
        else:
            self.before_write(-1, file.path, offset, len(view))
        pwrite_all(file.fd, view, offset)

    def truncate(self, file: DirectFile, size: int) -> None:
        """Set the size of ``file`` (opened by :meth:`open`) to ``size`` bytes (a file grown this
        way reads as zeros where nothing was written)."""
        self.before_truncate(file.path, size)
        os.ftruncate(file.fd, size)

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

    def pread(self, file: DirectFile, offset: int, nbytes: int) -> bytes:
        """At most ``nbytes`` at ``offset`` of ``file`` (opened by :meth:`open_read`): one read
        request, shorter at the end of the file, empty past it."""
        self._read_request(file, offset, nbytes)
        return os.pread(file.fd, nbytes, offset)

    def read_into(self, file: DirectFile, view: memoryview, offset: int) -> int:
        """Fill ``view`` from ``offset`` of ``file`` (opened by :meth:`open_read`) until it is full
        or the file ends: one read request; returns the bytes read."""
        self._read_request(file, offset, len(view))
        return pread_into(file.fd, view, offset)

    def _read_request(self, file: DirectFile, offset: int, nbytes: int) -> None:
        if file.on_read is not None:  # open_read()'s hook
            file.on_read(offset, nbytes)
        else:
            self.before_read(file.path, offset, nbytes)

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

    def exchange(self, a: str, b: str) -> bool:
        """Swap the names ``a`` and ``b`` in one atomic step (``renameat2(RENAME_EXCHANGE)``);
        False, nothing changed, where the system or the filesystem cannot."""
        self.before_rename(b)
        return _exchange(a, b)

    def fsync_dir(self, path: str) -> None:
        self.before_fsync(path)
        fsync_dir(path)

    def stat(self, path: str, *, follow: bool = True) -> os.stat_result:
        """``os.stat`` of ``path`` (``os.lstat`` unless ``follow``)."""
        self.before_stat(path)
        return os.stat(path, follow_symlinks=follow)

    def exists(self, path: str) -> bool:
        """Whether ``path`` names anything (a link is not followed)."""
        self.before_stat(path)
        return os.path.lexists(path)

    def is_dir(self, path: str, *, follow: bool = True) -> bool:
        """Whether ``path`` is a directory; through a link only if ``follow`` (without it, a
        link to a directory is not one)."""
        self.before_stat(path)
        try:
            return stat.S_ISDIR(os.stat(path, follow_symlinks=follow).st_mode)
        except (OSError, ValueError):
            return False

    def makedirs(self, path: str) -> None:
        """Create the directory ``path`` and its missing parents (nothing if it exists)."""
        self.before_mkdir(path)
        os.makedirs(path, exist_ok=True)

    def make_temp_dir(self, prefix: str, parent: str | None = None) -> str:
        """A new private directory (mode 0700) named ``prefix`` + random letters in ``parent``
        (default: the system's temporary directory); returns its path."""
        self.before_mkdir(os.path.join(parent if parent is not None else tempfile.gettempdir(), prefix))
        return tempfile.mkdtemp(prefix=prefix, dir=parent)

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

    def swap_lock_note(self, fd: int, path: str, note: bytes) -> bytes:
        """Replace the note (who holds it) of the lock file ``path``, held through ``fd`` from
        :meth:`lock`, with ``note``; returns the previous note (at most LOCK_NOTE_BYTES)."""
        self.before_lock(path)
        previous = os.pread(fd, LOCK_NOTE_BYTES, 0)
        os.ftruncate(fd, 0)
        pwrite_all(fd, memoryview(note), 0)
        return previous

    def unlock(self, fd: int, path: str) -> None:
        """Release the lock :meth:`lock` took: its note is emptied (nothing was left behind)
        and ``fd`` closed (closed even if emptying fails)."""
        try:
            self.before_lock(path)
            os.ftruncate(fd, 0)
        finally:
            os.close(fd)

    def read_lock_note(self, path: str) -> bytes:
        """The note of the lock file ``path`` that another process holds (for a message)."""
        self.before_lock(path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        try:
            return os.pread(fd, LOCK_NOTE_BYTES, 0)
        finally:
            os.close(fd)


LOCK_NOTE_BYTES = 4096
_HAS_ONEXC = sys.version_info >= (3, 12)
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_libc: ctypes.CDLL | None = None


def _exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically; False where the system or filesystem cannot."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        except OSError:  # no C library to ask (an unusual libc): the two-rename path
            return False
    fn = getattr(_libc, "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), b)


REAL_FILES = FileBackend()  # the default: what a caller that passes no backend uses
