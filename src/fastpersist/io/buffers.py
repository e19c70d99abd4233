"""Page-aligned host memory and the fixed pool of staging buffers.

O_DIRECT needs the memory address, the file offset and the length of every request aligned to
the device's block. fastpersist aligns everything to :data:`ALIGN` (4 KiB, the page and the
physical block of common SSDs), which satisfies any logical block size up to 4 KiB.

Buffers are torch uint8 tensors, so device-to-host copies land in them directly. When CUDA is
present they are page-locked with ``cudaHostRegister`` on memory fastpersist maps itself
(:class:`_RegisteredMemory`), not taken from torch's pinned allocator: that allocator rounds
every request up to a power of two and keeps freed blocks cached for the life of the process,
so a 32 MiB buffer (plus alignment slack) took 64 MiB of page-locked memory and a snapshot
arena of 1.1 GiB took 2 GiB, the old one still held after the arena grew. Registered memory is
exactly the size asked for and is unregistered and unmapped when its last view goes. Every
CUDA runtime call made here goes through :class:`CudaHost`; :func:`use_cuda_host` replaces it
(a fake runtime runs this path without a device).

The pool keeps its buffers for the life of the process: first touch of fresh memory is several
times slower than reuse on virtual machines that hand idle guest memory back to the host. A pool
that may sit idle for long (``fastpersist.save``'s) lends its idle buffers' pages to the kernel
(:meth:`BufferPool.lend_idle`, ``MADV_FREE``): they stay in place, and cost nothing to use again,
unless memory runs short, when the kernel takes them; :attr:`BufferPool.warm` tells which.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import threading
import weakref
from typing import Any

import torch

from fastpersist.io.fills import wait_filled

logger = logging.getLogger(__name__)

ALIGN = 4096


def align_down(n: int, align: int = ALIGN) -> int:
    return n - (n % align)


def align_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def memory_view(addr: int, nbytes: int) -> memoryview:
    """A writable memoryview of ``nbytes`` at ``addr``; the caller keeps the owner alive.
    Memory a snapshot is still being copied into is viewed once its bytes are there
    (:mod:`fastpersist.io.fills`)."""
    if nbytes == 0:
        return memoryview(bytearray())
    wait_filled(addr, nbytes)
    return memoryview((ctypes.c_ubyte * nbytes).from_address(addr)).cast("B")


_MADV_POPULATE_WRITE = 23  # Linux 5.14+
_libc: ctypes.CDLL | None = None


def populate(addr: int, nbytes: int) -> bool:
    """Fault in (and zero) fresh memory ahead of use, in the kernel, in one call.

    An O_DIRECT read into never-touched memory faults its pages one by one inside the read;
    populating them from another thread while earlier requests are in flight overlaps that
    work with the I/O. Returns False where the kernel does not support it (nothing is done).
    """
    return _madvise(addr, nbytes, _MADV_POPULATE_WRITE)


_MADV_FREE = 8  # Linux 4.5+


def _lib() -> ctypes.CDLL:
    """The C library, its calls typed once: an untyped call would pass an address as a C int."""
    global _libc
    if _libc is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        _libc = lib
    return _libc


def _madvise(addr: int, nbytes: int, advice: int) -> bool:
    start = align_down(addr)
    return _lib().madvise(start, addr + nbytes - start, advice) == 0


def lend(addr: int, nbytes: int) -> bool:
    """Let the kernel take the whole pages of ``[addr, addr + nbytes)`` if it needs memory
    (``MADV_FREE``); until it does, they stay in place, and writing to them keeps them. The
    bytes must be of no further use: a taken page reads as zeros. False where the kernel does
    not support it (nothing is done)."""
    start = align_up(addr)
    end = align_down(addr + nbytes)
    return end <= start or _madvise(start, end - start, _MADV_FREE)


def resident(addr: int, nbytes: int) -> bool:
    """Whether every page of ``[addr, addr + nbytes)`` is in memory (``mincore``): a page never
    touched, or taken back by the kernel, is not. True where the kernel cannot tell."""
    start = align_down(addr)
    pages = (addr + nbytes - start + ALIGN - 1) // ALIGN
    if pages <= 0:
        return True
    vec = (ctypes.c_ubyte * pages)()
    if _lib().mincore(start, pages * ALIGN, vec) != 0:
        return True
    return b"\x00" not in bytes(vec)  # bit 0: resident (the only bit Linux sets)


_FAULT_STEP = 64 << 20


def fault_in(addr: int, nbytes: int) -> None:
    """Fault in every page of fresh memory now (in the kernel where it can, else by writing
    zeros), in steps that each release the GIL: memory touched for the first time costs
    many times a copy into it (docs/BENCHMARKS.md, "The first save: cold memory and `reserve()`"), so whoever can pay it
    ahead of time, off the path that waits, does."""
    for start in range(0, nbytes, _FAULT_STEP):
        n = min(_FAULT_STEP, nbytes - start)
        if not populate(addr + start, n):
            ctypes.memset(addr + start, 0, n)


_CUDA_HOST_REGISTER_PORTABLE = 1  # page-locked for every CUDA context, as torch's own stager does


class CudaHost:
    """The CUDA runtime calls staging makes on the host: whether a device is there,
    page-locking memory (``cudaHostRegister``) and unlocking it, torch's pinned allocator (the
    fallback), and the events that mark a save point (:data:`ready_events`).

    This class is the real runtime. :func:`use_cuda_host` puts another implementation in its
    place, process-wide: a fake one runs the page-locked path without a device (the tests), an
    instrumented one counts what is locked. A subclass overrides what it changes.
    """

    def present(self) -> bool:
        """Whether a CUDA device is there (staging memory is then page-locked by default)."""
        return torch.cuda.is_available()

    def register(self, addr: int, size: int) -> int:
        """Page-lock ``size`` bytes at ``addr`` for every CUDA context; the CUDA error code
        (0: success). Called in a throwaway thread, so that a refusal (which stays its thread's
        last CUDA error) never reaches training's threads; an exception counts as a failure."""
        return int(torch.cuda.cudart().cudaHostRegister(addr, size, _CUDA_HOST_REGISTER_PORTABLE))

    def unregister(self, addr: int) -> int:
        """Unlock the memory registered at ``addr``; the CUDA error code (0: success)."""
        return int(torch.cuda.cudart().cudaHostUnregister(addr))

    def torch_pinned(self, size: int) -> torch.Tensor:
        """``size`` bytes from torch's pinned allocator, page-aligned (its blocks are); raises
        RuntimeError where torch cannot pin memory."""
        raw = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if raw.data_ptr() % ALIGN == 0:
            return raw
        raw = torch.empty(size + ALIGN, dtype=torch.uint8, pin_memory=True)
        pad = (-raw.data_ptr()) % ALIGN
        return raw[pad : pad + size]

    def record_event(self, device: torch.device) -> Any:
        """A CUDA event recorded now on ``device``'s current stream: copies of that device's
        memory wait for it (``Stream.wait_event``) instead of for the whole device."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(device))
        return ev


_cuda_host = CudaHost()
_register_warned = False


class _UsingCudaHost:
    """Returned by :func:`use_cuda_host`: already in effect; as a context manager it restores."""

    def __init__(self, previous: CudaHost, warned: bool) -> None:
        self._previous = previous
        self._warned = warned

    def __enter__(self) -> CudaHost:
        return _cuda_host

    def __exit__(self, *exc: object) -> None:
        global _cuda_host, _register_warned
        _cuda_host, _register_warned = self._previous, self._warned


def use_cuda_host(host: CudaHost) -> _UsingCudaHost:
    """Make ``host`` the CUDA runtime that staging calls, process-wide, from now on; ``with
    use_cuda_host(host):`` puts the previous one back on exit.

    The failure to page-lock memory is said once per runtime: a new one may say it again (the
    "said once" state is reset here, and restored on exit). Memory already page-locked is
    unlocked by the runtime that locked it, whichever is in use when its last view goes.
    """
    global _cuda_host, _register_warned
    using = _UsingCudaHost(_cuda_host, _register_warned)
    _cuda_host, _register_warned = host, False
    return using


class _RegisteredMemory(mmap.mmap):
    """Anonymous, page-aligned memory, page-locked with ``cudaHostRegister`` while it lives.

    ``torch.frombuffer`` keeps this object alive as long as any tensor views it; when the last
    view goes, :meth:`__del__` unregisters the range (through the runtime that registered it)
    before the mapping is unmapped (memory must never be unmapped while the driver holds it
    registered).
    """

    registered: int = 0  # the registered address, 0 if registration failed
    host: CudaHost | None = None  # the runtime that registered it

    def __del__(self) -> None:
        addr, self.registered = self.registered, 0
        if not addr or self.host is None:
            return
        try:
            err = self.host.unregister(addr)
            if err:
                logger.warning("cudaHostUnregister of staging memory at %#x failed (%d)", addr, err)
        except Exception:  # noqa: BLE001, S110 - interpreter shutdown (module state gone): the process is ending
            pass


def pinned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-aligned host memory, page-locked for device-to-host copies.

    Exactly ``nbytes`` (rounded up to a page) are mapped and registered. Where registration
    fails (some sandboxes do not support it), torch's pinned allocator is used instead (sizes
    rounded up to a power of two), and failing that, pageable memory (slower copies); either
    fallback is logged once.
    """
    host = _cuda_host
    size = align_up(max(nbytes, 1))
    mem = _RegisteredMemory(-1, size)
    tensor = torch.frombuffer(mem, dtype=torch.uint8)  # keeps ``mem`` alive while any view lives
    addr = tensor.data_ptr()
    err = _register(host, addr, size)
    if err == 0:
        mem.registered, mem.host = addr, host
        return tensor[:nbytes]
    try:
        fallback = host.torch_pinned(size)
        how = "torch's pinned allocator is used instead (it rounds sizes up to a power of two)"
    except RuntimeError as e:
        fallback, how = tensor, f"staging memory stays pageable and device-to-host copies are slower ({e})"
    _warn_once(f"cudaHostRegister of {size} bytes failed (cudaError {err}): {how}")
    return fallback[:nbytes]


class SharedMemory:
    """Host memory another process maps too: a ``memfd`` (not a file of ``/dev/shm``, so not
    bounded by its size: a container's is often 64 MiB), mapped shared, page-aligned, and
    page-locked when CUDA is present (registered like :func:`pinned_empty`'s memory).

    ``fd`` stays open while the object lives: it is what another process maps
    (:func:`map_shared`, after receiving it over a Unix socket). :attr:`tensor` is a uint8
    view of exactly ``nbytes``.
    """

    def __init__(self, nbytes: int, pin: bool | None = None, name: str = "fastpersist") -> None:
        size = align_up(max(nbytes, 1))
        self.fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            mem = _RegisteredMemory(self.fd, size)  # MAP_SHARED
        except BaseException:
            os.close(self.fd)
            raise
        self._finalizer = weakref.finalize(self, os.close, self.fd)
        self.size = size
        tensor = torch.frombuffer(mem, dtype=torch.uint8)  # keeps ``mem`` alive while any view lives
        if pin is None:
            pin = _cuda_host.present()
        if pin:
            host = _cuda_host
            err = _register(host, tensor.data_ptr(), size)
            if err == 0:
                mem.registered, mem.host = tensor.data_ptr(), host
            else:
                _warn_once(f"cudaHostRegister of {size} bytes of shared memory failed (cudaError {err}): "
                           "device-to-host copies into it are slower")
        self.tensor = tensor[:nbytes]

    def close(self) -> None:
        """Close the descriptor now (the mapping lives on while a view does)."""
        self._finalizer()


def map_shared(fd: int, nbytes: int) -> torch.Tensor:
    """A uint8 view of ``nbytes`` of the shared memory behind ``fd`` (another process's
    :class:`SharedMemory`); the mapping lives while a view does. ``fd`` may be closed after."""
    mem = mmap.mmap(fd, align_up(max(nbytes, 1)))
    return torch.frombuffer(mem, dtype=torch.uint8)[:nbytes]


def _register(host: CudaHost, addr: int, size: int) -> int:
    """``cudaHostRegister`` in a thread of its own; returns the CUDA error code (0: success).

    A failed CUDA runtime call stays its thread's "last error", and torch's check after its
    next kernel launch in that thread would report it as the kernel's own failure. A throwaway
    thread keeps a refusal (some sandboxes refuse registration) away from training's threads.
    """
    out: list[int] = []

    def run() -> None:
        try:
            out.append(int(host.register(addr, size)))
        except Exception as e:  # noqa: BLE001 - reported as a failed registration
            logger.debug("cudaHostRegister raised %s", e)

    t = threading.Thread(target=run, name="fastpersist-register")
    t.start()
    t.join()
    return out[0] if out else -1


def _warn_once(message: str) -> None:
    global _register_warned
    if not _register_warned:
        _register_warned = True
        logger.warning("%s", message)


def aligned_empty(nbytes: int, pin: bool | None = None) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` whose first byte is :data:`ALIGN`-aligned.

    ``pin`` defaults to pinning when CUDA is available: the memory is then mapped and
    registered by :func:`pinned_empty`. Otherwise the tensor is a view into a slightly larger
    allocation of torch's CPU allocator, which it keeps alive.
    """
    if pin is None:
        pin = _cuda_host.present()
    if pin:
        return pinned_empty(nbytes)
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
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
        self._made: list[StagingBuffer] = []  # every buffer made, in use or idle
        self._lock = threading.Lock()
        self._preparing: threading.Thread | None = None
        self._stop = threading.Event()  # set at interpreter exit: a preparation ends after its buffer

    def _make(self) -> StagingBuffer:
        buf = StagingBuffer(self.nbytes, self._pin)
        with self._lock:
            self._made.append(buf)
        return buf

    def acquire(self, timeout: float | None = None) -> StagingBuffer:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            make = self._created < self.count
            if make:
                self._created += 1
        if make:
            try:
                return self._make()
            except BaseException:
                with self._lock:
                    self._created -= 1
                raise
        return self._free.get(timeout=timeout)

    def release(self, buf: StagingBuffer) -> None:
        self._free.put(buf)

    def prepare(self) -> None:
        """Allocate every buffer not made yet, its pages faulted in, ahead of the first write
        that needs it (a write waiting for a buffer gets each one as soon as it is ready); fault
        in again the idle buffers whose pages the kernel took back (:meth:`lend_idle`). Stops
        after the buffer in hand once the interpreter exits."""
        for buf in self._idle():
            try:
                if not self._stop.is_set() and not resident(buf.addr, buf.nbytes):
                    fault_in(buf.addr, buf.nbytes)
            finally:
                self._free.put(buf)
        while not self._stop.is_set():
            with self._lock:
                if self._created >= self.count:
                    return
                self._created += 1
            try:
                buf = StagingBuffer(self.nbytes, self._pin)
                fault_in(buf.addr, buf.nbytes)
            except BaseException:
                with self._lock:  # the pool keeps its size: a later acquire makes this buffer
                    self._created -= 1
                raise
            with self._lock:
                self._made.append(buf)
            self._free.put(buf)

    def prepare_in_background(self) -> None:
        """:meth:`prepare`, then :meth:`lend_idle`, on a thread of its own (one at a time), so
        that the next write finds the pool warm. A failure is logged: the next write makes
        what is missing itself. The interpreter's exit waits for the buffer in hand and no more
        (:func:`_stop_preparing`)."""
        with self._lock:
            if self._stop.is_set() or (self._preparing is not None and self._preparing.is_alive()):
                return
            if not _watch_at_exit(self):
                return  # the interpreter is exiting: nobody will write through the pool again
            self._preparing = threading.Thread(target=self._prepare_quietly, name="fastpersist-staging",
                                               daemon=True)
            self._preparing.start()

    def wait_prepared(self, timeout: float | None = None) -> bool:
        """Wait for :meth:`prepare_in_background`'s thread, if one runs; False on timeout."""
        with self._lock:
            thread = self._preparing
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def _prepare_quietly(self) -> None:
        try:
            self.prepare()
            if not self._stop.is_set():
                self.lend_idle()
        except Exception as e:  # noqa: BLE001 - the pool stays usable; the next write makes buffers
            logger.warning("preparing %d staging buffers of %d bytes failed: %s", self.count, self.nbytes, e)

    def _idle(self) -> list[StagingBuffer]:
        """Take every idle buffer out of the pool now (the caller puts each back)."""
        out = []
        while True:
            try:
                out.append(self._free.get_nowait())
            except queue.Empty:
                return out

    def lend_idle(self) -> None:
        """Lend the pages of every idle buffer to the kernel (:func:`lend`): kept, unless memory
        runs short. Page-locked buffers are never lent."""
        if self._pin or (self._pin is None and _cuda_host.present()):
            return
        for buf in self._idle():
            try:
                lend(buf.addr, buf.nbytes)
            finally:
                self._free.put(buf)

    @property
    def warm(self) -> bool:
        """Whether every buffer is made and all its pages are in memory: a write through the
        pool then touches no fresh memory."""
        with self._lock:
            made = list(self._made)
        return len(made) >= self.count and all(resident(b.addr, b.nbytes) for b in made)

    @property
    def created(self) -> int:
        """How many buffers the pool has allocated so far (at most ``count``)."""
        return self._created


_preparing_pools: weakref.WeakSet[BufferPool] = weakref.WeakSet()
_at_exit_registered = False
_at_exit_lock = threading.Lock()


def _watch_at_exit(pool: BufferPool) -> bool:
    """Have the interpreter's exit stop and wait for ``pool``'s preparation (False once the
    interpreter is exiting: no preparation starts then).

    A daemon thread still inside torch when the interpreter finalizes is ended by the runtime
    in the middle of a C++ frame, which aborts the process (``terminate called without an
    active exception``, exit status 134): a script that called ``fastpersist.save`` once and
    returned would fail after its checkpoint was written. threading's exit hooks run before
    finalization, while every thread can still finish."""
    global _at_exit_registered
    with _at_exit_lock:
        if not _at_exit_registered:
            register = getattr(threading, "_register_atexit", None)
            try:
                if register is None:  # pragma: no cover - every supported Python has it
                    import atexit

                    atexit.register(_stop_preparing)
                else:
                    register(_stop_preparing)
            except RuntimeError:  # "can't register atexit after shutdown"
                return False
            _at_exit_registered = True
        _preparing_pools.add(pool)
    return True


def _stop_preparing() -> None:
    """At interpreter exit: every pool's preparation ends after the buffer in hand; wait for it."""
    with _at_exit_lock:
        pools = list(_preparing_pools)
    for pool in pools:
        pool._stop.set()
    for pool in pools:
        pool.wait_prepared()


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


# ---------------------------------------------------------------------------------------------
# Device-to-host copies into staging memory


class _ReadyEvents:
    """When each guarded device storage held the state being saved, as CUDA events.

    ``save()`` runs on the training thread and records, on that thread's current stream, an
    event after which a guarded (live) storage holds exactly the state to save
    (:meth:`mark`). Background copies of that storage wait for the event on a side stream:
    they see the state at ``save()``, and do not queue behind the forward and backward work
    training has queued since. An entry is valid until the next optimizer step of any
    optimizer (a global step pre-hook clears them all): only a step may change a guarded
    storage, and the guard keeps the step from running until the copies are done. Without a
    valid entry, a copy first synchronizes the device (every stream), which is always correct.
    """

    def __init__(self) -> None:
        self._events: dict[int, Any] = {}
        self._lock = threading.Lock()
        self._hooked = False

    def mark(self, storages: list[torch.UntypedStorage]) -> None:
        events: dict[torch.device, Any] = {}
        marks = {}
        for s in storages:
            if s.device.type != "cuda":
                continue
            ev = events.get(s.device)
            if ev is None:
                ev = events[s.device] = _cuda_host.record_event(s.device)
            marks[s.data_ptr()] = ev
        if not marks:
            return
        self._ensure_hook()
        with self._lock:
            self._events.update(marks)

    def _ensure_hook(self) -> None:
        with self._lock:
            if not self._hooked:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                register_optimizer_step_pre_hook(self._invalidate)
                self._hooked = True

    def get(self, storage_address: int) -> Any:
        with self._lock:
            return self._events.get(storage_address)

    def _invalidate(self, *_: Any) -> None:
        with self._lock:
            self._events.clear()


ready_events = _ReadyEvents()
_streams = threading.local()


def _side_stream(device: torch.device) -> Any:
    """This thread's copy stream on ``device`` (never the default stream training runs on)."""
    streams = getattr(_streams, "by_device", None)
    if streams is None:
        streams = _streams.by_device = {}
    s = streams.get(device)
    if s is None:
        s = streams[device] = torch.cuda.Stream(device=device)
    return s


def copy_to_host(dst: memoryview, src: torch.Tensor) -> None:
    """Copy the bytes of ``src`` (a 1-D uint8 tensor on any device) into host memory ``dst``.

    CUDA memory is copied on a side stream of the calling thread, ordered after the state
    being saved (:class:`_ReadyEvents`), and waited for before returning.
    """
    host = torch.frombuffer(dst, dtype=torch.uint8) if len(dst) else torch.empty(0, dtype=torch.uint8)
    if src.device.type != "cuda":
        host.copy_(src)
        return
    ready = ready_events.get(src.untyped_storage().data_ptr())
    if ready is None:
        torch.cuda.synchronize(src.device)  # no recorded save point: everything queued so far, every stream
    stream = _side_stream(src.device)
    with torch.cuda.stream(stream):
        if ready is not None:
            stream.wait_event(ready)
        host.copy_(src, non_blocking=True)
    stream.synchronize()
