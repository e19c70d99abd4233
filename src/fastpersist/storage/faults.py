"""Fault injection: a file backend that fails, slows down or kills at a chosen place.

fastpersist's own crash and fault suites use it, and so can a user who wants to see what their
job does when a disk fills up or a rank dies in the middle of a checkpoint::

    from fastpersist.storage.faults import Fault, FaultyBackend
    backend = FaultyBackend([Fault("write", errno.ENOSPC, at=3, rank=2)])
    ckpt = fastpersist.Checkpointer(roots, backend=backend)

A :class:`Fault` matches an operation (``open`` (creating a file), ``write`` (each write
request), ``truncate`` (setting a file's size), ``fsync`` (files and directories), ``rename``
(rename, replace, the atomic exchange of a publish), ``link``, ``delete`` (unlink, rmdir,
rmtree), ``list`` (a directory listing), ``mkdir`` (creating directories), ``stat`` (stat,
lstat, exists, is_dir), ``lock`` (the root lock and its note), ``read`` (opening a checkpoint
file for reading, and each read request), or a protocol ``event`` from
:data:`fastpersist.storage.backend.PROTOCOL_POINTS`), optionally only on one rank, one root, one
path or paths containing a string, and fires on the ``at``-th matching call (0: every call).
It then sleeps ``delay_s``, and raises ``OSError(errno)`` (naming the path), or kills the
process with SIGKILL. Everything else is real I/O.
"""

from __future__ import annotations

import errno as errno_codes
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from fastpersist.storage.backend import PROTOCOL_POINTS, FileBackend

OPS = ("open", "write", "fsync", "rename", "delete", "list", "lock", "read", "event", "link", "mkdir", "stat",
       "truncate")


@dataclass
class Fault:
    op: str
    errno: int | None = errno_codes.EIO  # None: no error (a delay or a kill only)
    at: int = 1  # fire on the at-th matching call in this process; 0: on every one
    rank: int | None = None
    root: int | None = None
    path_contains: str | None = None
    point: str | None = None  # for op="event"
    delay_s: float = 0.0
    kill: bool = False
    path: str | None = None  # only this exact path (as fastpersist names it)

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"unknown operation {self.op!r}; one of {OPS}")
        if self.op == "event" and self.point not in PROTOCOL_POINTS:
            raise ValueError(f"an event fault needs point= one of {PROTOCOL_POINTS}")


def _current_rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except ImportError:  # pragma: no cover
        pass
    return 0


class FaultyBackend(FileBackend):
    """Real files, with :class:`Fault` s injected. ``fired`` lists what fired, in order."""

    def __init__(self, faults: Sequence[Fault] = ()) -> None:
        self._lock = threading.Lock()
        self.arm(faults)

    def arm(self, faults: Sequence[Fault]) -> None:
        """Replace the faults (and restart their call counts)."""
        with self._lock:
            self.faults = list(faults)
            self.fired: list[tuple[str, str]] = []
            self._counts = [0] * len(self.faults)

    def _hit(self, op: str, root: int | None = None, path: str = "", point: str | None = None) -> None:
        for i, f in enumerate(self.faults):
            if f.op != op or (f.point is not None and f.point != point):
                continue
            if f.rank is not None and f.rank != _current_rank():
                continue
            if f.root is not None and f.root != root:
                continue
            if f.path_contains is not None and f.path_contains not in path:
                continue
            if f.path is not None and f.path != path:
                continue
            with self._lock:
                self._counts[i] += 1
                fire = f.at == 0 or self._counts[i] == f.at
                if fire:
                    self.fired.append((op, point or path))
            if not fire:
                continue
            if f.delay_s:
                time.sleep(f.delay_s)
            if f.kill:
                os.kill(os.getpid(), signal.SIGKILL)
            if f.errno is not None:
                raise OSError(f.errno, f"{os.strerror(f.errno)} (injected {op} fault)", path or point)

    def before_open(self, root: int, path: str) -> None:
        self._hit("open", root, path)

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        self._hit("write", root, path)

    def before_fsync(self, path: str) -> None:
        self._hit("fsync", None, path)

    def before_rename(self, dst: str) -> None:
        self._hit("rename", None, dst)

    def event(self, point: str) -> None:
        self._hit("event", point=point)

    def before_delete(self, path: str) -> None:
        self._hit("delete", None, path)

    def before_list(self, path: str) -> None:
        self._hit("list", None, path)

    def before_lock(self, path: str) -> None:
        self._hit("lock", None, path)

    def before_read(self, path: str, offset: int | None, nbytes: int | None) -> None:
        self._hit("read", None, path)

    def before_link(self, root: int, src: str, dst: str) -> None:
        self._hit("link", root, dst)

    def before_mkdir(self, path: str) -> None:
        self._hit("mkdir", None, path)

    def before_stat(self, path: str) -> None:
        self._hit("stat", None, path)

    def before_truncate(self, path: str, size: int) -> None:
        self._hit("truncate", None, path)


class HoldWrite(FaultyBackend):
    """A :class:`FaultyBackend` that also stops the process in the middle of one save: the
    ``at``-th write request to a data file of step ``step``'s checkpoint calls ``signal()`` (the
    process tells whoever will kill it that it is mid-write: the earlier data is written, no
    manifest exists) and then never returns. Crash tests and the demo SIGKILL the process on
    that signal, so the kill lands mid-save every time, not by chance."""

    def __init__(self, step: int, signal: Callable[[], None], at: int = 2, faults: Sequence[Fault] = ()) -> None:
        super().__init__(faults)
        self.marker = os.sep + f"step-{step:08d}" + os.sep
        self.signal = signal
        self.at = at
        self._seen = 0
        self._counting = threading.Lock()  # (not `_lock`: FaultyBackend's own)

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        super().before_write(root, path, offset, nbytes)
        if self.marker not in path or not path.endswith(".bin"):
            return
        with self._counting:
            self._seen += 1
            hold = self._seen == self.at
        if hold:
            self.signal()
            threading.Event().wait(_NEVER_KILLED_S)  # the SIGKILL comes first
            os._exit(3)


_NEVER_KILLED_S = 600.0  # a held process nobody kills exits (status 3) rather than hang for ever


class NodeLocal(FileBackend):
    """Real files, but only those of one simulated node: every path below ``base`` that is not
    under ``base/<node>`` is another node's disk, and opening, reading, listing, creating,
    locking, linking or deleting it fails with EACCES (queries of what a path is are not
    refused). Tests and benchmarks run several "nodes" on one machine with it, so that
    a rank provably opens only its own node's roots."""

    def __init__(self, base: str, node: str) -> None:
        self.base = os.path.abspath(base)
        self.mine = os.path.join(self.base, node)

    def check(self, path: str) -> None:
        p = os.path.abspath(path)
        if p.startswith(self.base + os.sep) and not (p == self.mine or p.startswith(self.mine + os.sep)):
            raise PermissionError(errno_codes.EACCES, f"{p} lies on another node's disks", p)

    def before_open(self, root: int, path: str) -> None:
        self.check(path)

    def before_read(self, path: str, offset: int | None, nbytes: int | None) -> None:
        self.check(path)

    def before_list(self, path: str) -> None:
        self.check(path)

    def before_delete(self, path: str) -> None:
        self.check(path)

    def before_lock(self, path: str) -> None:
        self.check(path)

    def before_link(self, root: int, src: str, dst: str) -> None:
        self.check(src)
        self.check(dst)

    def before_mkdir(self, path: str) -> None:
        self.check(path)
