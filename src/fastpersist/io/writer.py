"""The pipelined O_DIRECT writer: the first of fastpersist's three techniques.

A file is described as an ordered list of :class:`Piece` objects, each a byte range of the file
and where its bytes live (a small ``bytes`` object, or a uint8 tensor on any device). The writer
turns the list into write requests:

* a CPU tensor whose memory address and file offset share their alignment phase (both
  aligned, or both 64 bytes past a page, ...) is written straight from its memory (no copy);
  only its unaligned head and tail go through the pool;
* everything else is copied into page-aligned staging buffers of ``chunk_bytes`` from a fixed
  pool; while buffer k is being written by a writer thread, the caller fills buffer k+1;
* the last partial page of the range goes through the buffered descriptor, after every direct
  request has completed, so no page is written both ways at once.

Host memory that a snapshot is still copying into is read only once its bytes are there
(:func:`fastpersist.io.fills.wait_filled`): the write of a snapshot starts with its copy.

Pieces with a ``tag`` are hashed (xxh3-64) in file order while they pass through (while a
snapshot copy runs, once it is over: :class:`_Hashers`), and
:func:`write_pieces` returns the digests. Copies use ``ctypes.memmove`` and hashing uses xxhash,
both of which release the GIL; the training thread keeps running while the writer works.

A :class:`WriteObserver` (:func:`observe_writes`) is told which bytes are copied and when bytes
are hashed. :class:`WriterThreads` is the request level underneath: aligned requests in, written
by the file's threads.
"""

from __future__ import annotations

import bisect
import collections
import ctypes
import errno
import os
import queue
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointWriteError
from fastpersist.io.buffers import ALIGN, BufferPool, StagingBuffer, align_down, copy_to_host, memory_view
from fastpersist.io.files import DirectFile, pwrite_all
from fastpersist.io.fills import filling, wait_filled

# Copy and hash in steps of this size so the hash reads bytes the copy left in the cache.
_STEP = 1 << 20


@dataclass(frozen=True)
class Piece:
    """``nbytes`` bytes of the file at ``offset``, taken from ``data``, ``tensor`` or ``addr``.

    ``tensor`` must be a contiguous 1-D uint8 tensor of exactly ``nbytes`` (a byte view of a
    storage, on any device); ``addr`` is the address of ``nbytes`` bytes of host memory (the
    cheaper way to describe CPU memory). The caller keeps the bytes unchanged, and their owner
    alive, until the write completes.
    """

    offset: int
    nbytes: int
    data: bytes | None = None
    tensor: torch.Tensor | None = None
    tag: Hashable | None = None
    addr: int | None = None

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


class WriteObserver:
    """What the writer does with the pieces' bytes, told as it happens; this base class ignores
    it all. :func:`observe_writes` puts one in place, process-wide: to profile a write path (the
    bytes copied on their way to the file against those written straight from memory, when
    hashing runs) or to check one in a test. Its methods run on the thread that writes the
    file, in its innermost loop: they must be quick and must not raise.
    """

    def copied(self, piece: Piece, nbytes: int) -> None:
        """``nbytes`` of ``piece`` are copied on their way to the file (into a staging buffer,
        or the buffered last page); what is never told here is written from its own memory."""

    def hashed(self, tag: Hashable, nbytes: int) -> None:
        """``nbytes`` of the piece tagged ``tag`` are hashed, now (called just before)."""


_observer: WriteObserver | None = None


class _Observing:
    """Returned by :func:`observe_writes`: already in effect; as a context manager it restores."""

    def __init__(self, previous: WriteObserver | None) -> None:
        self._previous = previous

    def __enter__(self) -> WriteObserver | None:
        return _observer

    def __exit__(self, *exc: object) -> None:
        global _observer
        _observer = self._previous


def observe_writes(observer: WriteObserver | None) -> _Observing:
    """Tell ``observer`` what every write does from now on (None: no one); ``with
    observe_writes(observer):`` puts the previous observer back on exit."""
    global _observer
    observing = _Observing(_observer)
    _observer = observer
    return observing


@dataclass(frozen=True)
class _Segment:
    piece: Piece
    start: int  # offset inside the piece
    nbytes: int


class _Pieces:
    """Sorted pieces with lookup of the segments that cover a file range."""

    def __init__(self, pieces: Sequence[Piece]) -> None:
        self.pieces = sorted((p for p in pieces if p.nbytes > 0), key=lambda p: p.offset)
        for a, b in zip(self.pieces, self.pieces[1:]):
            if b.offset < a.end:
                raise ValueError(f"pieces overlap at offsets {a.offset} and {b.offset}")
        tags = [p.tag for p in self.pieces if p.tag is not None]
        if len(set(tags)) != len(tags):
            raise ValueError("two pieces have the same tag (a tag names one piece's digest)")
        self._ends = [p.end for p in self.pieces]

    def segments(self, start: int, end: int) -> Iterator[_Segment]:
        i = bisect.bisect_right(self._ends, start)
        while i < len(self.pieces) and self.pieces[i].offset < end:
            p = self.pieces[i]
            s = max(start, p.offset)
            e = min(end, p.end)
            yield _Segment(p, s - p.offset, e - s)
            i += 1


def _cpu_address(piece: Piece) -> int | None:
    if piece.addr is not None:
        return piece.addr
    t = piece.tensor
    if t is None or t.device.type != "cpu":
        return None
    return int(t.data_ptr())


class _Hashers:
    """The running digest of every tagged piece, fed in file order.

    While a snapshot copy is still running (:func:`fastpersist.io.fills.filling`, a pipelined
    save) hashing waits: the bytes are noted, and hashed once the copy is over, a bounded
    amount per request submitted (:meth:`catch_up`), so the disk keeps being fed. Hashing beside
    the copy would take the CPU and memory bandwidth that ``save()``'s copy needs on a machine
    with few cores (docs/DESIGN.md, "The snapshot pipeline"); deferred, it overlaps the writes
    only. Noted bytes must stay unchanged until the file is written (the :class:`Piece`
    contract), so only memory the caller owns is noted, never a staging buffer.
    """

    def __init__(self, defer: bool = False) -> None:
        self._h: dict[Hashable, xxhash.xxh3_64] = {}
        self._whole: dict[Hashable, int] = {}  # pieces hashed in one call
        self._later: collections.deque[tuple[Hashable, memoryview]] | None = collections.deque() if defer else None

    @property
    def deferring(self) -> bool:
        return self._later is not None

    def _now(self, tag: Hashable, view: memoryview) -> None:
        if _observer is not None:
            _observer.hashed(tag, len(view))
        h = self._h.get(tag)
        if h is None:
            h = self._h[tag] = xxhash.xxh3_64()
        h.update(view)

    def update(self, tag: Hashable | None, view: memoryview) -> None:
        """Hash ``view`` (bytes of a staging buffer: hashed now, in order with what was noted)."""
        if tag is None:
            return
        if self._later is not None:
            self.catch_up()  # the noted bytes come first in the file
        self._now(tag, view)

    def note(self, tag: Hashable | None, view: memoryview) -> None:
        """Hash ``view`` (the caller's own memory), now or, while a copy runs, later."""
        if tag is None:
            return
        if self._later is not None:
            self._later.append((tag, view))
        else:
            self._now(tag, view)

    def whole(self, tag: Hashable | None, staged: memoryview, addr: int) -> None:
        """Hash a whole piece, copied into ``staged`` from the caller's memory at ``addr``."""
        if tag is None:
            return
        if self._later is not None:
            self._later.append((tag, memory_view(addr, len(staged))))
        else:
            if _observer is not None:
                _observer.hashed(tag, len(staged))
            self._whole[tag] = xxhash.xxh3_64_intdigest(staged)

    def catch_up(self, budget: int | None = None) -> None:
        """Hash up to ``budget`` noted bytes (every one if None), once no copy runs any more;
        with every noted byte hashed, hash at once from then on."""
        later = self._later
        if later is None or (budget is not None and filling()):
            return
        done = 0
        while later and (budget is None or done < budget):
            tag, view = later.popleft()
            self._now(tag, view)
            done += len(view)
        if not later:
            self._later = None

    def digests(self, pieces: Sequence[Piece]) -> dict[Hashable, int]:
        self.catch_up()
        out = {}
        whole = self._whole
        for p in pieces:
            if p.tag is not None:
                if p.tag in whole:
                    out[p.tag] = whole[p.tag]
                    continue
                h = self._h.get(p.tag)
                out[p.tag] = h.intdigest() if h is not None else xxhash.xxh3_64_intdigest(b"")
        return out


def _fill(buf_addr: int, buf_view: memoryview, seg: _Segment, dst: int, hashers: _Hashers) -> None:
    """Copy one segment into a staging buffer at ``dst`` and hash it."""
    p = seg.piece
    if _observer is not None:
        _observer.copied(p, seg.nbytes)
    if p.data is not None:
        src = memoryview(p.data)[seg.start : seg.start + seg.nbytes]
        buf_view[dst : dst + seg.nbytes] = src
        hashers.note(p.tag, src)
        return
    src_addr = _cpu_address(p)
    if p.tensor is None and src_addr is None:
        raise ValueError(f"piece at offset {p.offset} has neither data, tensor nor address")
    if src_addr is None and p.tensor is not None:  # device memory: one copy on a side stream (buffers.py)
        copy_to_host(buf_view[dst : dst + seg.nbytes], p.tensor[seg.start : seg.start + seg.nbytes])
    done = 0
    while done < seg.nbytes:
        n = min(_STEP, seg.nbytes - done)
        d = dst + done
        if src_addr is not None:
            wait_filled(src_addr + seg.start + done, n)  # a snapshot still being copied (fills.py)
            ctypes.memmove(buf_addr + d, src_addr + seg.start + done, n)
            if hashers.deferring:
                hashers.note(p.tag, memory_view(src_addr + seg.start + done, n))
            else:  # the bytes the copy just left in the cache
                hashers.update(p.tag, buf_view[d : d + n])
        else:
            hashers.update(p.tag, buf_view[d : d + n])
        done += n


class WriterThreads:
    """The writer threads of one file, taking (view, offset, buffer) requests; the first error
    stops them all.

    The caller makes it (``count`` threads, leased at once: a thread that cannot start fails
    it), :meth:`submit` s requests in any order, then :meth:`join` s, which raises the first
    error. A request is written with O_DIRECT while the file has it; one the filesystem refuses
    with EINVAL is written again through the buffered descriptor, and O_DIRECT is dropped for the
    file. The buffer of a request, if any, goes back to ``pool`` once it is written or dropped.

    The threads are leased from a crew kept between files (:class:`_Crew`): starting threads
    for every file cost each save about a millisecond of GIL time, taken from training.
    """

    def __init__(self, file: DirectFile, pool: BufferPool, count: int) -> None:
        self.file = file
        self.pool = pool
        self.error: BaseException | None = None
        self._q: queue.Queue[tuple[memoryview, int, StagingBuffer | None] | None] = queue.Queue(
            maxsize=max(2, pool.count)
        )
        self._count = count
        self._serving = count
        self._joined = False
        self._done = threading.Condition(threading.Lock())
        _CREW.lease(self, count)

    def submit(self, view: memoryview, offset: int, buf: StagingBuffer | None) -> None:
        """Write ``view`` at ``offset`` (``buf``: the pool's buffer it lies in, or None); after
        an error the request is dropped. Blocks while the queue is full."""
        if self.error is not None:
            if buf is not None:
                self.pool.release(buf)
            return
        self._q.put((view, offset, buf))

    def _write(self, view: memoryview, offset: int) -> None:
        f = self.file
        if f.on_write is not None:
            f.on_write(offset, len(view))
        if f.is_direct:
            try:
                pwrite_all(f.direct_fd, view, offset)
                return
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                f.refuse_direct("O_DIRECT write: EINVAL")
        pwrite_all(f.fd, view, offset)

    def serve(self) -> None:
        """Run by a leased thread: write requests until the end marker. Nothing of a request
        (views of the caller's tensors) is left behind in the thread when this returns."""
        while (item := self._q.get()) is not None:
            self._one(*item)

    def sign_off(self) -> None:
        """A leased thread is done with this file (after :meth:`serve`)."""
        with self._done:
            self._serving -= 1
            self._done.notify_all()

    def _one(self, view: memoryview, offset: int, buf: StagingBuffer | None) -> None:
        try:
            if self.error is None:
                self._write(view, offset)
        except BaseException as e:  # noqa: BLE001 - handed to the caller in join()
            if self.error is None:
                self.error = _write_error(self.file.path, offset, len(view), e)
        finally:
            if buf is not None:
                self.pool.release(buf)

    def join(self) -> None:
        """Wait until every request has been written (or dropped after an error); raise the
        first error. Once joined, no request may be submitted; joining again only waits."""
        if not self._joined:
            self._joined = True
            for _ in range(self._count):
                self._q.put(None)
        with self._done:
            while self._serving:
                self._done.wait()
        if self.error is not None:
            raise self.error


class _Worker:
    """A writer thread of the crew: serves one file's requests at a time, then waits idle."""

    def __init__(self, crew: _Crew, number: int, nice: int) -> None:
        self._crew = crew
        self.nice = nice
        self._files: queue.SimpleQueue[WriterThreads | None] = queue.SimpleQueue()
        threading.Thread(target=self._run, name=f"fastpersist-writer-{number}", daemon=True).start()

    def serve(self, writers: WriterThreads) -> None:
        self._files.put(writers)

    def retire(self) -> None:
        """End the thread (it is idle and not wanted)."""
        self._files.put(None)

    def _run(self) -> None:
        keep = True
        while keep:
            writers = self._files.get()
            if writers is None:
                return
            try:
                writers.serve()
                # idle again before the file's writer hears it is done, so that the next file
                # leases this thread instead of starting one
                keep = self._crew.back(self)
            except BaseException:  # noqa: BLE001 - never idle again; the file's writer is told below
                keep = False
                if writers.error is None:
                    writers.error = CheckpointWriteError(f"a writer thread of {writers.file.path} failed")
            finally:
                writers.sign_off()
                del writers


class _Crew:
    """The process's idle writer threads. A file leases as many as it writes with; each comes
    back when the file's writes end. Files written at once get threads of their own, so one
    file never waits for another's. At most ``keep`` idle threads stay; a forked child starts
    with none (its parent's threads do not exist there).

    A thread starts with the CPU niceness of the thread that started it (Linux: per thread),
    and an unprivileged thread cannot lower its niceness again; so threads are kept apart by
    niceness, and a file is written by threads of its own writer's niceness: a nice'd thread
    (the durable tier's drain runs at 10) never lends its priority to a save's writes, nor the
    other way round."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._idle: dict[int, list[_Worker]] = {}  # by niceness
        self._started = 0
        os.register_at_fork(after_in_child=self._forget)

    def lease(self, writers: WriterThreads, count: int) -> None:
        """Give ``writers`` ``count`` threads; if a thread cannot be started, none is given and
        the threads taken go back."""
        nice = _niceness()
        with self._lock:
            idle = self._idle.get(nice, [])
            workers = [idle.pop() for _ in range(min(count, len(idle)))]
        try:
            while len(workers) < count:
                with self._lock:
                    self._started += 1
                    number = self._started
                workers.append(_Worker(self, number, nice))  # started by this thread: its niceness
        except BaseException:
            for w in workers:
                if not self.back(w):
                    w.retire()
            raise
        for w in workers:
            w.serve(writers)

    def back(self, worker: _Worker) -> bool:
        """``worker`` is idle again; False when enough are idle already (it ends)."""
        with self._lock:
            if sum(len(v) for v in self._idle.values()) >= self._keep:
                return False
            self._idle.setdefault(worker.nice, []).append(worker)
            return True

    def idle(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._idle = {}


def _niceness() -> int:
    """The calling thread's niceness (Linux: per thread; elsewhere the process's)."""
    try:
        return os.getpriority(os.PRIO_PROCESS, 0)
    except (OSError, AttributeError):
        return 0


_CREW = _Crew(keep=16)


def _write_error(path: str, offset: int, nbytes: int, cause: BaseException) -> CheckpointWriteError:
    if isinstance(cause, CheckpointWriteError):
        return cause
    what = cause.strerror if isinstance(cause, OSError) and cause.strerror else repr(cause)
    hint = ""
    if isinstance(cause, OSError) and cause.errno == errno.ENOSPC:
        hint = " (no space left on the device: free space or write elsewhere)"
    err = CheckpointWriteError(
        f"writing {path} failed at offset {offset} ({nbytes} bytes): {what}{hint}"
    )
    err.__cause__ = cause
    return err


def _direct_span(piece: Piece, file: DirectFile, config: IOConfig) -> tuple[int, int] | None:
    """(head, length): the part of ``piece`` written straight from its memory, if any.

    With O_DIRECT that needs the memory address and the file offset to share their alignment
    phase: the ``head`` bytes up to the next aligned file offset go through the pool, then
    ``length`` (a multiple of ALIGN) bytes go straight from memory.
    """
    addr = _cpu_address(piece)
    if addr is None or piece.nbytes < max(config.zero_copy_min_bytes, ALIGN):
        return None
    if not file.is_direct:
        return 0, piece.nbytes
    if (addr - piece.offset) % ALIGN:
        return None
    head = (-piece.offset) % ALIGN
    length = align_down(piece.nbytes - head)
    return (head, length) if length > 0 else None


def write_pieces(
    file: DirectFile, pieces: Sequence[Piece], config: IOConfig, pool: BufferPool
) -> dict[Hashable, int]:
    """Write ``pieces`` (which must not overlap) into ``file``; return the tagged digests.

    Gaps between pieces are written as zeros inside staged chunks. The file is not fsync'd:
    that is the caller's step, once everything it wants durable is written.
    """
    index = _Pieces(pieces)
    if not index.pieces:
        return {}
    end = index.pieces[-1].end
    direct_end = align_down(end) if file.is_direct else end
    hashers = _Hashers(defer=filling())
    writers = WriterThreads(file, pool, config.writer_threads)
    try:
        staged_from = 0
        for p in index.pieces:
            span = _direct_span(p, file, config)
            if span is None or p.offset + span[0] >= direct_end:
                continue
            head, length = span
            middle_end = min(p.offset + head + length, direct_end)
            _staged(writers, index, staged_from, p.offset + head, config, pool, hashers)
            _direct(writers, p, head, middle_end - p.offset - head, config, hashers)
            staged_from = middle_end
        _staged(writers, index, staged_from, direct_end, config, pool, hashers)
        if hashers.deferring and filling():  # this file's bytes are copied, others are not yet:
            writers.join()  # leave the CPU to the copy while the last requests are written
        hashers.catch_up()  # while the last requests are written, if not done above
    except BaseException:
        writers.error = writers.error or CheckpointWriteError(f"writing {file.path} was interrupted")
        try:
            writers.join()
        except CheckpointWriteError:
            pass
        raise
    writers.join()
    if direct_end < end:
        _buffered_tail(file, index, direct_end, end, hashers)
    return hashers.digests(index.pieces)


def _staged(
    writers: WriterThreads,
    index: _Pieces,
    start: int,
    end: int,
    config: IOConfig,
    pool: BufferPool,
    hashers: _Hashers,
) -> None:
    """Copy [start, end) through the pool in chunk-sized requests."""
    observer = _observer
    pos = start
    while pos < end:
        if writers.error is not None:
            raise writers.error
        n = min(config.chunk_bytes, end - pos)
        buf = pool.acquire()
        try:
            filled = 0
            for k, seg in enumerate(index.segments(pos, pos + n)):
                if k & 31 == 31:
                    time.sleep(0)  # many small pieces: let a waiting training thread have the GIL
                piece = seg.piece
                dst = piece.offset + seg.start - pos
                if dst > filled:
                    ctypes.memset(buf.addr + filled, 0, dst - filled)
                if piece.addr is not None and seg.nbytes == piece.nbytes <= _STEP:  # a whole small piece
                    wait_filled(piece.addr, seg.nbytes)  # a snapshot still being copied (fills.py)
                    if observer is not None:
                        observer.copied(piece, seg.nbytes)
                    ctypes.memmove(buf.addr + dst, piece.addr, seg.nbytes)
                    hashers.whole(piece.tag, buf.view[dst : dst + seg.nbytes], piece.addr)
                else:
                    _fill(buf.addr, buf.view, seg, dst, hashers)
                filled = dst + seg.nbytes
            if filled < n:
                ctypes.memset(buf.addr + filled, 0, n - filled)
        except BaseException:
            pool.release(buf)
            raise
        writers.submit(buf.view[:n], pos, buf)
        hashers.catch_up(2 * n)
        pos += n


def _direct(
    writers: WriterThreads, piece: Piece, skip: int, nbytes: int, config: IOConfig, hashers: _Hashers
) -> None:
    """Write ``nbytes`` of ``piece`` from byte ``skip`` straight from its memory (no copy)."""
    addr = _cpu_address(piece)
    if addr is None:
        raise ValueError("zero-copy writes need a CPU tensor")
    pos = 0
    while pos < nbytes:
        if writers.error is not None:
            raise writers.error
        n = min(config.chunk_bytes, nbytes - pos)
        view = memory_view(addr + skip + pos, n)  # waits for a snapshot still being copied (fills.py)
        hashers.note(piece.tag, view)
        writers.submit(view, piece.offset + skip + pos, None)
        hashers.catch_up(2 * n)
        pos += n


def _buffered_tail(
    file: DirectFile, index: _Pieces, start: int, end: int, hashers: _Hashers
) -> None:
    """The last partial page, written through the page cache after every direct request."""
    tail = bytearray(end - start)
    view = memoryview(tail)
    holder = torch.frombuffer(tail, dtype=torch.uint8) if tail else None
    addr = holder.data_ptr() if holder is not None else 0
    for seg in index.segments(start, end):
        _fill(addr, view, seg, seg.piece.offset + seg.start - start, hashers)
    try:
        pwrite_all(file.fd, view, start)
    except OSError as e:
        raise _write_error(file.path, start, len(tail), e) from e
