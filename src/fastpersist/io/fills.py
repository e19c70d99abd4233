"""Host memory being filled while it is already being written: the snapshot pipeline.

``save()`` in the background modes copies the state into the snapshot arena. The copy and the
write used to run one after the other (copy everything, then write everything). Now the save
is queued first and ``save()`` copies into the arena front to back while the background writer
writes what is already there: a :class:`Fill` covers the arena's range and advances a
watermark (every byte below it holds its copy); :func:`wait_filled` blocks a reader until the
bytes it is about to read are below the watermark. Memory no fill covers is ready at once, so
the writer calls :func:`wait_filled` for every piece of host memory without knowing where it
lies. A copy that fails marks the fill failed: a reader waiting on it raises instead of reading
bytes that were never copied.
"""

from __future__ import annotations

import threading

from fastpersist.errors import CheckpointWriteError

_lock = threading.Lock()
_active: list[Fill] = []


class Fill:
    """``size`` bytes of host memory at ``base``, filled front to back."""

    def __init__(self, base: int, size: int) -> None:
        self.base = base
        self.size = size
        self._done = 0  # bytes from base holding their copy
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        with _lock:
            _active.append(self)

    def covers(self, addr: int, nbytes: int) -> bool:
        return addr < self.base + self.size and addr + nbytes > self.base

    def advance(self, done: int) -> None:
        """Every byte below ``base + done`` holds its copy."""
        with self._cond:
            if done > self._done:
                self._done = done
                self._cond.notify_all()

    def fail(self, error: BaseException) -> None:
        """The copy stopped: readers of bytes not yet copied raise (until :meth:`close`, when
        the job that owns the memory has finished)."""
        with self._cond:
            if self._done >= self.size:  # every byte was copied: nothing a reader could miss
                return
            self._error = error
            self._cond.notify_all()

    def complete(self) -> None:
        self.advance(self.size)
        self.close()

    def close(self) -> None:
        """No longer a fill: readers no longer wait for it (after :meth:`complete` or :meth:`fail`)."""
        with _lock:
            if self in _active:
                _active.remove(self)

    def copying(self) -> bool:
        """The copy is still running: neither complete nor failed."""
        return self._done < self.size and self._error is None

    def wait(self, end: int) -> None:
        """Until every byte below ``end`` (relative to ``base``) holds its copy."""
        with self._cond:
            while self._done < end and self._error is None:
                self._cond.wait()
            if self._done < end and self._error is not None:
                raise CheckpointWriteError(f"the snapshot copy failed before these bytes were copied: {self._error!r}"
                                           ) from self._error

    def wait_all(self) -> None:
        self.wait(self.size)


def registered() -> int:
    """How many fills are registered now (one per pipelined save whose job holds its arena)."""
    with _lock:
        return len(_active)


def filling() -> bool:
    """Whether a snapshot copy is still running: a registered fill has neither completed nor
    failed (the writer hashes later while one is, :mod:`fastpersist.io.writer`)."""
    if not _active:
        return False
    with _lock:
        return any(f.copying() for f in _active)


def wait_filled(addr: int, nbytes: int) -> None:
    """Block until the ``nbytes`` of host memory at ``addr`` hold their snapshot copy (at once
    when no fill covers them)."""
    if not _active:  # the common case, without the lock: a fill is registered before its job is queued
        return
    with _lock:
        fills = [f for f in _active if f.covers(addr, nbytes)]
    for f in fills:
        f.wait(min(f.size, addr + nbytes - f.base))
