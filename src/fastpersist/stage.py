"""What must be copied at save time, and the bounded host memory it is copied into.

A checkpoint must equal the state at the moment ``save()`` was called, whatever training does
afterwards. The skeleton (Python values, tensor metadata) is pickled inside ``save()``, so it is
already a copy. The storages are the question:

* ``snapshot`` mode copies every storage into a :class:`Arena` (reusable, page-aligned, pinned
  when CUDA is present, never larger than its byte budget), then writes from there;
* ``overlap`` mode copies only the storages nothing guards. Storages of parameters and optimizer
  state of a protected optimizer are written from live memory: only ``optimizer.step()``
  changes them, and its pre-hook waits until they are written.

A copy from device memory is a device-to-host copy into page-locked memory on a side stream
of its device, ordered after the work training queued before ``save()``; ``save()`` waits for
those copies (the arena must hold the state before training may change it). A guarded device
storage is not copied here: the event recorded now on training's stream
(:data:`fastpersist.io.buffers.ready_events`) lets the background writer copy it later on its
own side stream, without queueing behind training's newer work.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from fastpersist import _torch, dtensor
from fastpersist.errors import CheckpointError
from fastpersist.format import manifest as mf
from fastpersist.format import skeleton, torchzip
from fastpersist.io.buffers import ALIGN, align_up, aligned_empty, fault_in, ready_events
from fastpersist.io.fills import Fill
from fastpersist.objects.write import Prepared, prepare

if TYPE_CHECKING:
    from fastpersist.job import SaveJob

logger = logging.getLogger(__name__)

COPY_STEP = 32 << 20  # a deferred copy lands (and may be written) in batches of about this size


class Arena:
    """Up to ``budget`` bytes of host memory for snapshots, reused save after save.

    One snapshot holds the arena from :meth:`take` until :meth:`give_back`; a second snapshot
    waits. Host memory for snapshots therefore never exceeds the budget. :meth:`reserve` makes
    the memory ready ahead of the first save that needs it.
    """

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise CheckpointError(f"the snapshot budget cannot be negative, got {budget}")
        self.budget = budget
        self._buffer: torch.Tensor | None = None
        self._cond = threading.Condition(threading.Lock())
        self._busy = False
        self._waiting: collections.deque[object] = collections.deque()  # claims in order of arrival
        self._held_by_reservation = False
        self._reservations: list[threading.Thread] = []

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def take(self, nbytes: int, timeout: float | None = None) -> torch.Tensor:
        """At least ``nbytes`` (at most the budget) of arena, once the previous user gave it back.

        The memory grows to the largest snapshot taken so far and is then reused.
        """
        if not self.fits(nbytes):
            raise CheckpointError(f"a snapshot of {nbytes} bytes exceeds the arena's budget of {self.budget}")
        self._claim(timeout)
        try:
            return self._grow(nbytes, touch=False)  # the copy faults the pages in as it goes
        except BaseException:
            self.give_back()
            raise

    def reserve(self, nbytes: int, then: Callable[[], None] | None = None) -> Future[int]:
        """Grow the arena to ``nbytes`` and fault its pages in, on a thread of its own, then
        run ``then`` there (more memory to make ready); the future gives the arena's size once
        both are done.

        The first touch of fresh memory is what makes a job's first snapshot slow (this
        machine: 1.7-3 s per GiB against 0.1 s for a copy into memory touched before,
        docs/BENCHMARKS.md "The first save"); reserved ahead, the first save copies into ready
        memory. The reservation takes its place in line at once and holds the arena while it
        works, so a save that comes before it is done waits for the rest of it (at most the
        first touch of the reserved size). A reservation that fails is logged; the arena is
        then grown by the next save that needs it, as without one.
        """
        if not self.fits(nbytes):
            raise CheckpointError(f"a reservation of {nbytes} bytes exceeds the arena's budget of {self.budget}")
        done: Future[int] = Future()
        nbytes = align_up(nbytes)
        grow = nbytes > self.allocated
        if not grow and then is None:
            done.set_result(self.allocated)
            return done
        turn = object()
        if grow:
            with self._cond:  # in line now: a save that follows waits for the reservation
                self._waiting.append(turn)

        def run() -> None:
            try:
                if grow:
                    self._claim(None, turn, reservation=True)
                    try:
                        self._grow(nbytes, touch=True)
                    finally:
                        self.give_back()
                if then is not None:
                    then()
                done.set_result(self.allocated)
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future, and logged
                logger.warning("reserving %d bytes of snapshot memory failed (%s: %s): the next save grows the "
                               "arena itself", nbytes, type(e).__name__, e)
                done.set_exception(e)

        thread = threading.Thread(target=run, name="fastpersist-reserve", daemon=True)
        try:
            thread.start()
        except BaseException:
            with self._cond:  # leave the line, or every later claim would wait for this turn
                if turn in self._waiting:
                    self._waiting.remove(turn)
                self._cond.notify_all()
            raise
        self._reservations = [t for t in self._reservations if t.is_alive()] + [thread]
        return done

    def join(self) -> None:
        """Wait for the reservations under way (close(): no thread of fastpersist outlives it)."""
        for thread in list(self._reservations):
            thread.join()

    def _claim(self, timeout: float | None, turn: object | None = None, reservation: bool = False) -> None:
        """Hold the arena, after every claim that came before (``turn``: a place in line taken
        earlier; ``reservation``: held by a reservation, not a snapshot)."""
        with self._cond:
            if turn is None:
                turn = object()
                self._waiting.append(turn)
            try:
                if not self._cond.wait_for(lambda: not self._busy and self._waiting[0] is turn, timeout):
                    raise TimeoutError("the snapshot arena is still in use")
            except BaseException:
                self._waiting.remove(turn)
                self._cond.notify_all()
                raise
            self._waiting.popleft()
            self._busy = True
            self._held_by_reservation = reservation

    def _grow(self, nbytes: int, touch: bool) -> torch.Tensor:
        """The buffer, grown to at least ``nbytes`` if smaller (the caller holds the arena);
        with ``touch``, its pages are faulted in now. Inside save() they are not: there the
        copy faulting each page as it lands measured faster (1.2-1.4 s for a cold GiB) than
        faulting them all first and copying after (2.0-3.5 s)."""
        if self._buffer is not None and self._buffer.numel() >= nbytes:
            return self._buffer
        self._buffer = None  # free the smaller one first
        buffer = aligned_empty(align_up(nbytes))
        if touch:
            fault_in(buffer.data_ptr(), buffer.numel())
        self._buffer = buffer
        return buffer

    def give_back(self) -> None:
        with self._cond:
            self._busy = self._held_by_reservation = False
            self._cond.notify_all()

    @property
    def busy(self) -> bool:
        """An earlier snapshot still holds the arena (its writes are not done); a reservation
        holding it does not count (``snapshot_pipeline="auto"`` reads this as saves coming
        faster than the disk takes them)."""
        return self._busy and not self._held_by_reservation

    @property
    def allocated(self) -> int:
        buffer = self._buffer
        return 0 if buffer is None else buffer.numel()


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity: its address (unique across host and devices: CUDA's unified
    virtual addressing gives device memory addresses apart from host memory)."""
    return storage.data_ptr()


def guarded_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_key(t.untyped_storage()) for t in tensors}


# Values a capture keeps as they are (the object itself): immutable, and pickled the same way
# at any later time. Subclasses of int, float, complex, str and bytes without an instance
# dictionary (numpy's scalars) and enum members are immutable too; anything else is not plain.
_IMMUTABLE = {int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size}
_SCALARS = (int, float, complex, str, bytes)


def _immutable(obj: Any) -> bool:
    t = type(obj)
    if t in _IMMUTABLE:
        return True
    return isinstance(obj, enum.Enum) or (isinstance(obj, _SCALARS) and not hasattr(obj, "__dict__"))


def _tensors(obj: Any, out: dict[int, torch.UntypedStorage]) -> bool:
    """Collect the storages of the tensors in ``obj``; False if something a capture would not
    rebuild exactly was met. The containers are the exact built-in types (an OrderedDict may
    carry attributes, as a module's state_dict carries ``_metadata``); a tensor is a dense
    torch.Tensor or Parameter, neither quantized, nested, nor a conjugate or negative view (a
    subclass or any other is pickled at save time instead, the way torch.save pickles it), and
    its Python attributes (torch.compile marks optimizer state with
    ``_dynamo_static_input_type``) are plain too: the capture copies them."""
    t = type(obj)
    if t is dict:
        return all([_tensors(v, out) for v in obj.values()])
    if t is list or t is tuple:
        return all([_tensors(v, out) for v in obj])
    if t is torch.Tensor or t is torch.nn.Parameter:
        if not skeleton.rebuilds_exactly(obj):
            return False
        s = obj.untyped_storage()
        out.setdefault(storage_key(s), s)
        attrs = obj.__dict__
        return not attrs or _tensors(attrs, out)
    if isinstance(obj, torch.Tensor):  # a subclass: pickled in save()
        return False
    if t is OrderedDict:
        return all([_tensors(v, out) for v in obj.values()]) and _tensors(vars(obj), out)
    return _immutable(obj)


def scan(obj: Any) -> tuple[bool, list[torch.UntypedStorage]]:
    """Whether ``obj`` is *plain* (only containers, tensors and immutable values: a state_dict's
    usual content, which :func:`capture` can copy without pickling it), and its storages."""
    found: dict[int, torch.UntypedStorage] = {}
    is_plain = _tensors(obj, found)
    return is_plain, list(found.values())


def copy_bytes(storages: Iterable[torch.UntypedStorage], live: set[int]) -> int:
    """Arena bytes needed to copy the storages not in ``live`` (each copy starts page-aligned)."""
    found = {storage_key(s): s for s in storages}
    return sum(align_up(s.nbytes()) for k, s in found.items() if k not in live)



class Capture:
    """A structural copy of a state: containers rebuilt, tensors re-pointed.

    Tensors on a ``live`` storage become aliases (same memory, metadata fixed now); every other
    storage is copied once into the arena and its tensors become views of the copy, so storages
    shared by several tensors stay shared. Only :func:`plain` objects can be captured this way;
    others are pickled at save time and only their storages are captured (:meth:`storage`). One
    capture serves a whole save, so a storage shared by several objects is copied once.
    """

    def __init__(self, live: set[int], arena: torch.Tensor | None, deferred: bool = False) -> None:
        self.live = live
        self.arena = arena
        self.pos = 0
        self.copied = 0
        # deferred: host-to-host copies are only laid out here and made by copy() (in arena order)
        self.deferred = deferred
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (destination, source, arena offset)
        self.copies: dict[int, torch.UntypedStorage] = {}
        self.streams: dict[torch.device, Any] = {}  # one side stream per device copied from
        self.live_seen: list[torch.UntypedStorage] = []

    def storage(self, s: torch.UntypedStorage) -> torch.UntypedStorage:
        key = storage_key(s)
        if key in self.live:
            self.live_seen.append(s)
            return s
        done = self.copies.get(key)
        if done is not None:
            return done
        n = s.nbytes()
        if n == 0:  # nothing to copy; a fresh empty storage (arena slices would alias the next copy)
            self.copies[key] = torch.UntypedStorage(0)
            return self.copies[key]
        if self.arena is None or self.pos + n > self.arena.numel():
            raise CheckpointError("internal: the snapshot arena is smaller than the state it must hold")
        dst = self.arena[self.pos : self.pos + n]
        src = torchzip.byte_view(s)
        if src.device.type == "cuda":  # pragma: no cover - no GPU in CI (tests/test_gpu.py)
            stream = self.streams.get(src.device)
            if stream is None:  # device-to-host copies on a side stream of that device, into pinned memory
                stream = self.streams[src.device] = torch.cuda.Stream(device=src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        elif self.deferred:
            self.pending.append((dst, src, self.pos))
        else:
            dst.copy_(src)
        self.pos += align_up(n, ALIGN)
        self.copied += n
        out = dst.untyped_storage()[dst.storage_offset() : dst.storage_offset() + n]  # type: ignore[index]
        self.copies[key] = out
        return out

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.live:
            self.live_seen.append(storage)
            view = t.detach()  # same memory; shape, strides and offset fixed now
        else:
            s = self.storage(storage)
            view = torch.empty(0, dtype=t.dtype, device=s.device).set_(s, t.storage_offset(), t.size(), t.stride())
        if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(view, requires_grad=t.requires_grad)
        if t.requires_grad:
            view.requires_grad_(True)
        return view

    def __call__(self, obj: Any) -> Any:
        """A copy of the plain object ``obj`` (:func:`scan`) that pickles as ``obj`` would have
        pickled at this moment."""
        t = type(obj)
        if t is dict:
            return {k: self(v) for k, v in obj.items()}
        if t is list:
            return [self(v) for v in obj]
        if t is tuple:
            return tuple([self(v) for v in obj])
        if isinstance(obj, torch.Tensor):
            view = self.tensor(obj)
            attrs = obj.__dict__
            if attrs:
                vars(view).update(self(attrs))
            return view
        if t is OrderedDict:
            out: OrderedDict[Any, Any] = OrderedDict([(k, self(v)) for k, v in obj.items()])
            attrs = vars(obj)
            if attrs:
                vars(out).update(self(attrs))
            return out
        if _immutable(obj):
            return obj
        raise CheckpointError(f"internal: {type(obj).__name__} cannot be captured without pickling")

    def copy(self, fill: Fill) -> None:
        """Make the deferred copies front to back, advancing ``fill`` as they land: the writer
        reads each part of the arena as soon as it holds its copy (fastpersist.io.fills).

        Copies go in batches of about COPY_STEP bytes, each one call to torch: between calls
        this thread needs the GIL again, and the save's background thread may hold it for up
        to the interpreter's switch interval (5 ms), so a state of many small tensors copied
        one call each would keep ``save()`` waiting for the GIL far longer than copying."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        batch = 0
        for dst, src, pos in self.pending:
            n = dst.numel()
            for start in range(0, n, COPY_STEP):
                end = min(n, start + COPY_STEP)
                dsts.append(dst[start:end])
                srcs.append(src[start:end])
                batch += end - start
                if batch >= COPY_STEP:
                    _torch.copy_many(dsts, srcs)
                    fill.advance(pos + end)
                    dsts, srcs, batch = [], [], 0
        if dsts:
            _torch.copy_many(dsts, srcs)
        self.pending.clear()

    def finish(self) -> None:
        for stream in self.streams.values():  # pragma: no cover - no GPU in CI (tests/test_gpu.py)
            stream.synchronize()
        ready_events.mark(self.live_seen)  # guarded device storages: the save point, for the writer


class OverlapGuard:
    """Overlap mode's guard: protected optimizers' tensors are written from live memory, and
    ``optimizer.step()`` waits (through a step pre-hook) until every in-flight checkpoint that
    reads them has written them. ``in_flight`` lists the jobs not yet finished; ``after_wait``
    raises a background failure not yet raised."""

    def __init__(self, in_flight: Callable[[], list[SaveJob]], after_wait: Callable[[], None]) -> None:
        self._in_flight = in_flight
        self._after_wait = after_wait
        self._protected: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._protected:
            return
        self._protected.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    def storages(self) -> set[int]:
        """The storages of the protected optimizers' parameters and state (their local shards)."""
        tensors = []
        for opt in self._protected:
            for group in opt.param_groups:
                tensors += [dtensor.local(p) for p in group["params"] if isinstance(p, torch.Tensor)]
            for st in opt.state.values():
                tensors += [dtensor.local(v) for v in st.values() if isinstance(v, torch.Tensor)]
        return guarded_storages(tensors)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for job in [j for j in self._in_flight() if j.live]:
            t0 = time.perf_counter()
            job.handle.staged.result()
            job.metrics.step_wait_s += time.perf_counter() - t0
        self._after_wait()

    def remove(self) -> None:
        """Remove the step hooks (close())."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._protected.clear()


class Stager:
    """Makes a job independent of training from ``save()`` on, except for guarded tensors.

    Plain states (containers, tensors, immutable values) are captured structurally and pickled
    in the background; anything else is pickled at once. Unguarded storages are copied into the
    arena; :meth:`stage` returns False when they do not fit (the save then runs inline, from
    live memory, through the fixed staging pool).
    """

    def __init__(self, budget: int, rank: int) -> None:
        self.arena = Arena(budget)
        self.rank = rank

    def stage(self, job: SaveJob, live: set[int], pipeline: str = "off") -> bool:
        """Snapshot the job (``pipeline``: IOConfig.snapshot_pipeline, the copies deferred to
        :meth:`copy` so that they overlap the job's writes)."""
        local = [sh.tensor for sh in job.shards]
        storages, job.prepared = self._storages(job.state, job.rank_state, local)
        need = copy_bytes(storages, live)
        if not self.arena.fits(need):
            logger.info("checkpoint step %d needs %.1f MiB of snapshot memory, over the budget of %.1f MiB: "
                        "writing it from live memory, save() waits for its commit", job.step, need / 2**20,
                        self.arena.budget / 2**20)
            return False
        # "auto": pipelined when saves come faster than the disk takes them (this save waited
        # for an earlier one), where the commit's time holds training back, not the copy's
        behind = self.arena.busy or job.metrics.waited_for_previous
        arena = self.arena.take(need) if need else None
        job.uses_arena = arena is not None
        # host memory only: the copies are made by copy(), after the job is queued, while the
        # writer writes what has landed (device copies are asynchronous already)
        deferred = (arena is not None and (pipeline == "on" or (pipeline == "auto" and behind))
                    and all(s.device.type == "cpu" for s in storages))
        job.metrics.pipelined = deferred
        try:
            # one capture for the whole job: a storage shared by the state, the rank state and
            # the shards is copied once (the arena was sized for each storage once)
            cap = Capture(live, arena, deferred)
            if job.prepared is not None:
                for prepared in job.prepared:
                    if prepared is not None:
                        prepared.storages[:] = [cap.storage(st) for st in prepared.storages]
            else:
                job.state = cap(job.state)
                if job.rank_state is not None:
                    job.rank_state = cap(job.rank_state)
            for sh, t in zip(job.shards, [cap(t) for t in local]):
                sh.tensor = t
            if cap.pending and arena is not None:
                job.fill, job.capture = Fill(arena.data_ptr(), cap.pos), cap  # registered before the job is queued
            else:
                cap.finish()
        except BaseException:
            self.release(job)
            raise
        job.live = bool(live)
        job.metrics.bytes_copied = cap.copied
        return True

    def reserve(self, nbytes: int, then: Callable[[], None]) -> Future[int]:
        """Reserve ``nbytes`` of arena (none over the budget: such saves are written from live
        memory), then run ``then`` on the reservation's thread (:meth:`Arena.reserve`)."""
        if not self.arena.fits(nbytes):
            logger.info("reserve(): %.1f MiB of snapshot memory exceeds snapshot_bytes (%.1f MiB): saves of this size "
                        "are written from live memory", nbytes / 2**20, self.arena.budget / 2**20)
            nbytes = 0
        return self.arena.reserve(nbytes, then)

    def need(self, state: Any, rank_state: Any, local: list[torch.Tensor], live: set[int]) -> int:
        """The arena bytes a save of this (saveable) state would copy (:meth:`stage`)."""
        return copy_bytes(self._storages(state, rank_state, local)[0], live)

    def _storages(self, state: Any, rank_state: Any, local: list[torch.Tensor]
                  ) -> tuple[list[torch.UntypedStorage], tuple[Prepared, Prepared | None] | None]:
        """The storages a save copies, and the prepared objects where the state is not plain
        (pickled at once: only their storages are captured)."""
        objs = [state] + ([rank_state] if rank_state is not None else [])
        scans = [scan(o) for o in objs]
        shard_storages = scan(local)[1]
        if all(is_plain for is_plain, _ in scans):
            return [s for _, found in scans for s in found] + shard_storages, None
        rep = prepare(mf.REPLICATED, state)
        own = prepare(mf.rank_object(self.rank), rank_state) if rank_state is not None else None
        return rep.storages + (own.storages if own else []) + shard_storages, (rep, own)

    def copy(self, job: SaveJob) -> None:
        """Make a staged job's deferred copies (``save()``, once the job is queued: its writer
        writes each part of the arena as soon as it holds its copy). A failed copy fails the
        job: whatever waits for bytes it did not copy raises."""
        cap, fill = job.capture, job.fill
        if cap is None or fill is None:
            return
        try:
            job.capture = None
            cap.copy(fill)
            cap.finish()
            fill.complete()
        except BaseException as e:
            fill.fail(e)
            raise

    def release(self, job: SaveJob) -> None:
        """Give the job's arena back (idempotent)."""
        if job.fill is not None:
            job.fill.close()
        if job.uses_arena:
            job.uses_arena = False
            self.arena.give_back()
