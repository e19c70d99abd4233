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
import threading
from collections.abc import Callable

from fastpersist.errors import CheckpointError

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
        "fastpersist: O_DIRECT is not available for %s (%s); using buffered I/O on this filesystem",
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
        # seam for throttled and fault-injecting backends (see fastpersist.io.backend).
        self.on_write = on_write
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
