"""Opening files for O_DIRECT with an opportunistic fallback, and whole-buffer pread/pwrite.

Policy (``IOConfig.direct``): ``auto`` tries O_DIRECT and falls back to buffered I/O when the
filesystem refuses it (EINVAL on open, as tmpfs does, or on the first request, as some FUSE and
network filesystems do), logging the fallback once per filesystem; ``on`` turns a refusal into an
error; ``off`` never asks for O_DIRECT.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
from collections.abc import Callable

from fastpersist.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CorruptCheckpointError,
    UnsafeFileError,
)

logger = logging.getLogger(__name__)

O_DIRECT: int = getattr(os, "O_DIRECT", 0)

_warned: set[int] = set()
_warned_lock = threading.Lock()


def _log_fallback_once(path: str, reason: str) -> None:
    try:
        dev = os.stat(os.path.dirname(os.path.abspath(path)) or ".").st_dev
    except OSError:
        dev = -1
    with _warned_lock:
        if dev in _warned:
            return
        _warned.add(dev)
    logger.warning(
        "O_DIRECT is not available for %s (%s); using buffered I/O on this filesystem",
        path,
        reason,
    )


class DirectFile:
    """A file opened for positional I/O, with O_DIRECT where the filesystem allows it.

    ``fd`` is the buffered descriptor (always valid). ``direct_fd`` is an O_DIRECT descriptor of
    the same file, or -1 when the filesystem refused it; requests through it must be aligned.
    ``is_direct`` turns false when a request is refused later; the descriptor then stays open
    until :meth:`close`, since other threads may still be using it.
    """

    def __init__(self, path: str, flags: int, direct: str, mode: int = 0o644,
                 on_write: Callable[[int, int], None] | None = None) -> None:
        self.path = path
        # Called as on_write(offset, nbytes) by writer threads before each write request: the
        # seam for throttled and fault-injecting backends (see fastpersist.storage.backend).
        self.on_write = on_write
        # Called as on_read(offset, nbytes) before each read request (the read side of the seam).
        self.on_read: Callable[[int, int], None] | None = None
        self.fd = os.open(path, flags | os.O_CLOEXEC, mode)
        self.direct_fd = -1
        self._direct_ok = False
        if direct == "off" or not O_DIRECT:
            if direct == "on":
                self.close()
                raise CheckpointError(f"O_DIRECT is not supported on this platform ({path})")
            return
        try:
            reopen = flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC)
            self.direct_fd = os.open(path, reopen | O_DIRECT | os.O_CLOEXEC)
        except OSError as e:
            if e.errno != errno.EINVAL:
                self.close()
                raise
            if direct == "on":
                self.close()
                raise OSError(errno.EINVAL, "the filesystem refuses O_DIRECT and direct='on'") from e
            _log_fallback_once(path, "open with O_DIRECT: EINVAL")
        else:
            self._direct_ok = True

    @classmethod
    def open_for_read(cls, path: str, direct: str, *, follow: bool = False) -> DirectFile:
        """A checkpoint file opened for reading through :func:`open_regular` (regular files only,
        no link followed unless ``follow``), with an O_DIRECT descriptor of the same file where
        the filesystem allows it."""
        self = cls.__new__(cls)
        self.path, self.on_write, self.on_read, self.direct_fd, self._direct_ok = path, None, None, -1, False
        self.fd = open_regular(path, follow=follow)
        if direct == "off" or not O_DIRECT:
            return self
        try:
            dfd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC | O_DIRECT)
        except OSError as e:
            if direct == "on" and e.errno == errno.EINVAL:
                self.close()
                raise CheckpointReadError(f"{path}: the filesystem refuses O_DIRECT and direct='on'") from e
            _log_fallback_once(path, f"open with O_DIRECT: {e.strerror or e}")
            return self
        a, b = os.fstat(self.fd), os.fstat(dfd)
        if (a.st_dev, a.st_ino) != (b.st_dev, b.st_ino):  # /proc not what it should be
            os.close(dfd)
            return self
        self.direct_fd, self._direct_ok = dfd, True
        return self

    def read_exact(self, offset: int, nbytes: int) -> bytes:
        """``nbytes`` at ``offset`` through the buffered descriptor (see :func:`read_exact`)."""
        if self.on_read is not None:
            self.on_read(offset, nbytes)
        return read_exact(self.fd, self.path, offset, nbytes)

    @property
    def is_direct(self) -> bool:
        return self._direct_ok

    def refuse_direct(self, reason: str) -> None:
        """Stop using O_DIRECT (after the filesystem rejected a request)."""
        if self._direct_ok:
            self._direct_ok = False
            _log_fallback_once(self.path, reason)

    def close(self) -> None:
        self._direct_ok = False
        for name in ("direct_fd", "fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                setattr(self, name, -1)
                os.close(fd)


_KINDS = ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
          (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"), (stat.S_ISLNK, "symbolic link"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def open_regular(path: str, *, follow: bool = False) -> int:
    """Open ``path`` for reading; the file must be a regular file. Returns a descriptor.

    This is the only way fastpersist opens a checkpoint's files for reading. It never blocks
    (``O_NONBLOCK``: a FIFO is refused, not waited on) and, unless ``follow``, never follows a
    symbolic link in the last component (``O_NOFOLLOW``; the manifest's file names are plain
    names, so that is every component inside a checkpoint directory). Anything but a regular
    file (FIFO, device, socket, directory, link) is :class:`UnsafeFileError`; a missing file is
    :class:`CheckpointNotFoundError`; any other refusal is :class:`CheckpointReadError`. Each
    names the file.
    """
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"{path} does not exist") from e
    except OSError as e:
        if e.errno == errno.ELOOP and not follow:
            raise UnsafeFileError(f"{path} is a symbolic link; fastpersist does not follow links inside "
                                  "a checkpoint (copy the file in instead)") from e
        raise CheckpointReadError(f"cannot open {path}: {e.strerror or e}") from e
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise UnsafeFileError(f"{path} is a {_kind(mode)}, not a regular file; a checkpoint holds "
                                  "only regular files")
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_size(fd: int) -> int:
    return os.fstat(fd).st_size


def read_exact(fd: int, path: str, offset: int, nbytes: int) -> bytes:
    """``nbytes`` bytes at ``offset``; a short read is truncation (:class:`CorruptCheckpointError`),
    never retried: a read that returns nothing cannot advance."""
    buf = bytearray(nbytes)
    got = pread_into(fd, memoryview(buf), offset)
    if got < nbytes:
        raise CorruptCheckpointError(f"{path} is truncated: {nbytes} bytes expected at offset {offset}, "
                                     f"only {got} could be read")
    return bytes(buf)


def read_small_file(path: str, limit: int, what: str, *, follow: bool = False) -> bytes:
    """The whole of a small file (a manifest, a skeleton, ``latest``), read through
    :func:`open_regular` and refused, before any byte is read, if it is larger than ``limit``."""
    fd = open_regular(path, follow=follow)
    try:
        size = file_size(fd)
        if size > limit:
            raise CorruptCheckpointError(f"{path} is {size} bytes; a {what} may be at most {limit} bytes, "
                                         "so this is not one (or it is damaged)")
        try:
            return read_exact(fd, path, 0, size)
        except OSError as e:
            raise CheckpointReadError(f"cannot read {path}: {e.strerror or e}") from e
    finally:
        os.close(fd)


def pwrite_all(fd: int, view: memoryview, offset: int) -> None:
    """Write all of ``view`` at ``offset`` (os.pwrite may write less than asked)."""
    done = 0
    total = len(view)
    while done < total:
        n = os.pwrite(fd, view[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {n} bytes")
        done += n


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Read into ``view`` from ``offset`` until it is full or the file ends; bytes read."""
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            break
        done += n
    return done


def fsync_dir(path: str) -> None:
    """fsync a directory so that a rename or a new file in it is durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def preallocate(fd: int, size: int) -> None:
    """Reserve a file's blocks up front: a full disk fails before any data is written (and ext4
    allocates one contiguous extent). Filesystems that cannot do it are not an error."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
