"""The parallel reader: file byte ranges straight into destination memory.

Each :class:`ReadRequest` names a file range and the memory it goes to. Where the file offset
and the destination address share their alignment phase, the range past the first aligned
offset is read with O_DIRECT (the head before it through the page cache) in
``read_chunk_bytes`` requests spread over ``reader_threads`` threads (os.preadv releases the
GIL); a final partial block is read with O_DIRECT too when the destination has room for the
whole block, else through the page cache. Unaligned requests are read through the page cache.

:class:`Landed` tells a consumer which destination bytes the reads have filled so far, so that
checksums are computed while the rest is still being read (a load then ends a moment after
its last read, not one pass over the memory later).
"""

from __future__ import annotations

import bisect
import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import torch

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointReadError, CorruptCheckpointError
from fastpersist.io.buffers import ALIGN, align_down, align_up, aligned_empty, memory_view, populate
from fastpersist.io.files import DirectFile, pread_into


@dataclass(frozen=True)
class ReadRequest:
    """Read ``nbytes`` at file ``offset`` into memory at ``addr``.

    ``capacity`` is how many bytes at ``addr`` may be written (at least ``nbytes``); room for the
    whole last block lets it be read with O_DIRECT. ``fresh`` says the memory was never touched:
    it is then faulted in by helper threads ahead of the reads (see ``buffers.populate``).
    """

    offset: int
    nbytes: int
    addr: int
    capacity: int
    fresh: bool = False


@dataclass(frozen=True)
class _Job:
    offset: int
    nbytes: int  # bytes that must be read
    addr: int
    span: int  # bytes requested (>= nbytes; aligned for direct jobs)
    direct: bool


def _jobs(requests: Sequence[ReadRequest], file: DirectFile, chunk: int) -> list[_Job]:
    jobs: list[_Job] = []
    for r in requests:
        if r.nbytes == 0:
            continue
        if not file.is_direct or (r.offset - r.addr) % ALIGN:  # phases differ: page cache
            jobs.append(_Job(r.offset, r.nbytes, r.addr, r.nbytes, False))
            continue
        head = min((-r.offset) % ALIGN, r.nbytes)  # up to the first aligned offset: page cache
        if head:
            jobs.append(_Job(r.offset, head, r.addr, head, False))
        offset, addr, nbytes, capacity = r.offset + head, r.addr + head, r.nbytes - head, r.capacity - head
        direct_span = align_up(nbytes) if capacity >= align_up(nbytes) else align_down(nbytes)
        pos = 0
        while pos < direct_span:
            n = min(chunk, direct_span - pos)
            need = min(n, nbytes - pos)
            jobs.append(_Job(offset + pos, need, addr + pos, n, True))
            pos += n
        if direct_span < nbytes:
            rest = nbytes - direct_span
            jobs.append(_Job(offset + direct_span, rest, addr + direct_span, rest, False))
    return jobs


def _run(file: DirectFile, job: _Job) -> None:
    if file.on_read is not None:
        file.on_read(job.offset, job.nbytes)
    view = memory_view(job.addr, job.span)
    got = -1
    if job.direct and file.is_direct:
        try:
            got = pread_into(file.direct_fd, view, job.offset)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            file.refuse_direct("O_DIRECT read: EINVAL")
    if got < 0:
        got = pread_into(file.fd, view[: job.nbytes], job.offset)
    if got < job.nbytes:
        size = os.fstat(file.fd).st_size
        raise CorruptCheckpointError(
            f"{file.path} is truncated: {job.nbytes} bytes expected at offset {job.offset}, "
            f"but the file is {size} bytes long"
        )


class ReadsStopped(CheckpointReadError):
    """The reads were stopped (:meth:`Landed.stop`) or failed before the bytes waited for landed;
    the reads' own error, if any, is what the caller reports."""


class Landed:
    """The destination ranges the reads have filled, as merged ``[start, end)`` address spans.

    Reader threads :meth:`add` each completed read; a consumer :meth:`wait` s for the range it
    needs. :meth:`stop` ends the wait of every consumer (a read failed, or the load gave up) and
    makes the reads not yet started skip their work.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._stopped: str | None = None
        self._finished = False

    def add(self, addr: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._cond:
            start, end = addr, addr + nbytes
            lo = bisect.bisect_left(self._ends, start)  # first span that ends at or after start
            hi = bisect.bisect_right(self._starts, end)  # spans from lo to hi touch [start, end)
            if lo < hi:
                start = min(start, self._starts[lo])
                end = max(end, self._ends[hi - 1])
            self._starts[lo:hi] = [start]
            self._ends[lo:hi] = [end]
            self._cond.notify_all()

    def covered(self, addr: int, nbytes: int) -> bool:
        with self._cond:
            return self._covered(addr, nbytes)

    def _covered(self, addr: int, nbytes: int) -> bool:
        if nbytes <= 0:
            return True
        i = bisect.bisect_right(self._starts, addr) - 1
        return i >= 0 and self._ends[i] >= addr + nbytes

    def wait(self, addr: int, nbytes: int) -> None:
        """Block until ``[addr, addr + nbytes)`` is filled; raises :class:`ReadsStopped` if the
        reads stop first, and :class:`CheckpointReadError` if they all ended without filling it
        (a plan that reads less than it checks: a defect of fastpersist, never a hang)."""
        with self._cond:
            while not self._covered(addr, nbytes):
                if self._stopped is not None:
                    raise ReadsStopped(self._stopped)
                if self._finished:
                    raise CheckpointReadError(f"the reads ended without filling the {nbytes} bytes at {addr:#x} "
                                              "that were to be checked (a defect of fastpersist's read plan)")
                self._cond.wait()

    def finish(self) -> None:
        """Every read has ended: what is not filled now never will be."""
        with self._cond:
            self._finished = True
            self._cond.notify_all()

    def stop(self, why: str) -> None:
        with self._cond:
            if self._stopped is None:
                self._stopped = why
            self._cond.notify_all()

    @property
    def stopped(self) -> bool:
        return self._stopped is not None


_POPULATE_THREADS = 2


def allocate(path: str, nbytes: int) -> torch.Tensor:
    """A page-aligned host buffer of ``nbytes`` to read the checkpoint at ``path`` into.

    Callers size it only from byte counts already checked against the files' real sizes; if
    the memory is still not there, that is a :class:`CheckpointReadError` naming the file.
    """
    try:
        return aligned_empty(nbytes, pin=False)
    except (MemoryError, RuntimeError) as e:
        raise CheckpointReadError(f"{path}: cannot allocate {nbytes} bytes to read the checkpoint into "
                                  f"({type(e).__name__}: {str(e)[:120]})") from e


def _populate_ahead(requests: Sequence[ReadRequest], step: int, stop: threading.Event) -> list[threading.Thread]:
    """Threads that fault in the fresh destination memory, in file order, while reads run."""
    spans = [(r.addr + pos, min(step, r.capacity - pos))
             for r in requests if r.fresh for pos in range(0, r.capacity, step)]
    if not spans:
        return []

    def run(k: int) -> None:
        for addr, n in spans[k::_POPULATE_THREADS]:
            if stop.is_set() or not populate(addr, n):
                return

    threads = [threading.Thread(target=run, args=(k,), name=f"fastpersist-populate-{k}", daemon=True)
               for k in range(_POPULATE_THREADS)]
    for t in threads:
        t.start()
    return threads


def read_into(file: DirectFile, requests: Sequence[ReadRequest], config: IOConfig,
              progress: Callable[[int], None] | None = None, landed: Landed | None = None) -> None:
    """Read every request, in parallel; raises on the first failure.

    ``progress``, if given, is called with the byte count of each completed read (from the
    reader threads, so it must be thread-safe); the counts add up to the bytes requested.
    ``landed``, if given, hears of every destination range filled, and is stopped when a read
    fails; once it is stopped, reads not yet started are skipped (:class:`ReadsStopped`).
    """
    jobs = _jobs(requests, file, config.read_chunk_bytes)
    if not jobs:
        return
    stop = threading.Event()
    helpers = _populate_ahead(requests, config.read_chunk_bytes, stop)
    try:
        if len(jobs) == 1 or config.reader_threads == 1:
            for j in jobs:
                _guarded(file, j, progress, landed)
            return
        with ThreadPoolExecutor(max_workers=config.reader_threads, thread_name_prefix="fastpersist-reader") as ex:
            futures = [ex.submit(_guarded, file, j, progress, landed) for j in jobs]
            try:
                for f in futures:
                    f.result()
            except BaseException:
                for f in futures:
                    f.cancel()
                raise
    except BaseException as e:
        if landed is not None:
            landed.stop(f"reading {file.path} failed: {e}")
        raise
    finally:
        stop.set()
        for t in helpers:
            t.join()


def read_then_rebuild(read: Callable[[Landed], None], check: Callable[[Landed], None],
                      rebuild: Callable[[], Any], overlap: Callable[[], bool]) -> Any:
    """``read`` the bytes, ``check`` their checksums and ``rebuild`` the object over them.

    The reads run in a thread of their own and the checks follow them in another as the bytes
    land. Meanwhile ``overlap()`` says whether the rebuild reads no byte (see
    ``fastpersist.format.references.rebuild_reads_no_bytes``): then the object is rebuilt while
    the bytes are read, and a load ends a moment after its last read; else after the reads and
    the checks. The errors keep the order of a sequential load: a read's failure, then a
    checksum's, then the rebuild's (damaged bytes are the cause of a rebuild that fails on them).
    Every read and check has ended when this returns or raises; an interrupt stops the reads not
    yet started and waits only for those under way.
    """
    landed = Landed()

    def read_all() -> None:
        read(landed)
        landed.finish()

    ex = ThreadPoolExecutor(max_workers=2, thread_name_prefix="fastpersist-load")
    futures = [ex.submit(read_all), ex.submit(check, landed)]
    failed: Exception | None = None
    obj = None
    try:
        try:
            if overlap():
                obj = rebuild()
            else:
                wait_futures(futures)
                if all(f.exception() is None for f in futures):
                    obj = rebuild()
        except Exception as e:  # noqa: BLE001 - raised below, after the reads' and checks' errors
            failed = e
        wait_futures(futures)
    except BaseException:  # an interrupt: stop what has not started, wait for what has
        landed.stop("the load was interrupted")
        while True:
            try:
                wait_futures(futures)
                break
            except KeyboardInterrupt:
                continue  # the reads under way end soon; their files and memory must outlive them
        ex.shutdown()
        raise
    ex.shutdown()
    for f in futures:
        error = f.exception()
        if error is not None:
            raise error
    if failed is not None:
        raise failed
    return obj


def _guarded(file: DirectFile, job: _Job, progress: Callable[[int], None] | None = None,
             landed: Landed | None = None) -> None:
    if landed is not None and landed.stopped:
        raise ReadsStopped(f"reading {file.path} was stopped")
    try:
        _run(file, job)
        if progress is not None:
            progress(job.nbytes)
        if landed is not None:
            landed.add(job.addr, job.nbytes)
    except CheckpointReadError:
        raise
    except OSError as e:
        raise ReadFailedError(
            f"reading {file.path} failed at offset {job.offset} ({job.nbytes} bytes): {e.strerror or e}",
            file.path, job.offset, job.nbytes,
        ) from e


class ReadFailedError(CheckpointReadError):
    """A read request failed (an I/O error): where, so a caller can name what lies there."""

    def __init__(self, message: str, path: str, offset: int, nbytes: int) -> None:
        super().__init__(message)
        self.path, self.offset, self.nbytes = path, offset, nbytes
