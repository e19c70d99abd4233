"""Page-aligned host memory and the fixed pool of staging buffers.

O_DIRECT needs the memory address, the file offset and the length of every request aligned to
the device's block. fastpersist aligns everything to :data:`ALIGN` (4 KiB, the page and the
physical block of common SSDs), which satisfies any logical block size up to 4 KiB.

Buffers are torch uint8 tensors, so they can be pinned (``pin_memory``) when CUDA is present and
device-to-host copies land in them directly. The pool keeps its buffers for the life of the
process: first touch of fresh memory is several times slower than reuse on virtual machines that
hand idle guest memory back to the host.
"""

from __future__ import annotations

import ctypes
import queue
import threading

import torch

ALIGN = 4096


def align_down(n: int, align: int = ALIGN) -> int:
    return n - (n % align)


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``addr``; the caller keeps the owner alive."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_libc: ctypes.CDLL | None = None


def populate(addr: int, nbytes: int) -> bool:
    """Fault in (and zero) fresh memory ahead of use, in the kernel, in one call.

    An O_DIRECT read into never-touched memory faults its pages one by one inside the read;
    populating them from another thread while earlier requests are in flight overlaps that
    work with the I/O. Returns False where the kernel does not support it (nothing is done).
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    start = align_down(addr)
    return _libc.madvise(start, addr + nbytes - start, _MADV_POPULATE_WRITE) == 0


def _cuda_present() -> bool:
    return torch.cuda.is_available()


def aligned_empty(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose first byte is :data:`ALIGN`-aligned.

    The tensor is a view into a slightly larger allocation; it keeps that allocation alive.
    ``pin`` defaults to pinning when CUDA is available.
    """
    if pin is None:
        pin = _cuda_present()
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    pad = (-raw.data_ptr()) % ALIGN
    return raw[pad : pad + nbytes]


class StagingBuffer:
    """One aligned buffer of the pool."""

    __slots__ = ("tensor", "addr", "nbytes", "view")

    def __init__(self, nbytes: int, pin: bool | None = None) -> None:
        self.tensor = aligned_empty(nbytes, pin)
        self.addr = self.tensor.data_ptr()
        self.nbytes = nbytes
        self.view = memory_view(self.addr, nbytes)


class BufferPool:
    """A fixed set of staging buffers; :meth:`acquire` blocks until one is free.

    Host memory used for staging never exceeds ``count * nbytes``, whatever is written.
    """

    def __init__(self, nbytes: int, count: int, pin: bool | None = None) -> None:
        self.nbytes = nbytes
        self.count = count
        self._pin = pin
        self._free: queue.SimpleQueue[StagingBuffer] = queue.SimpleQueue()
        self._created = 0
        self._lock = threading.Lock()

    def acquire(self, timeout: float | None = None) -> StagingBuffer:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._created < self.count:
                self._created += 1
                return StagingBuffer(self.nbytes, self._pin)
        return self._free.get(timeout=timeout)

    def release(self, buf: StagingBuffer) -> None:
        self._free.put(buf)


_shared_pools: dict[tuple[int, int, int], BufferPool] = {}
_shared_lock = threading.Lock()


def shared_pool(nbytes: int, count: int, lane: int = 0) -> BufferPool:
    """The process-wide pool for this buffer size, count and lane, reused across saves.

    Concurrent saves may share a pool: each buffer returns to the pool when its write
    completes, so they only take turns. Files written at the same time by one save use
    different ``lane`` numbers, so a slow file never holds the buffers another one needs.
    """
    with _shared_lock:
        pool = _shared_pools.get((nbytes, count, lane))
        if pool is None:
            pool = _shared_pools[(nbytes, count, lane)] = BufferPool(nbytes, count)
        return pool
