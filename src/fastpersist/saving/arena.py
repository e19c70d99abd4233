"""The snapshot arena: bounded host memory that snapshots are copied into, reused save after save.

One snapshot holds the arena from :meth:`Arena.take` until :meth:`Arena.give_back`; host memory
for snapshots never exceeds the budget. :meth:`Arena.reserve` makes the memory ready ahead of
the first save that needs it (docs/DESIGN.md, "The first save and `reserve()`").
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future

import torch

from fastpersist.errors import CheckpointError
from fastpersist.io.buffers import SharedMemory, align_up, aligned_empty, fault_in

logger = logging.getLogger(__name__)


class Arena:
    """Up to ``budget`` bytes of host memory for snapshots, reused save after save.

    One snapshot holds the arena from :meth:`take` until :meth:`give_back`; a second snapshot
    waits. Host memory for snapshots therefore never exceeds the budget. :meth:`reserve` makes
    the memory ready ahead of the first save that needs it.
    """

    def __init__(self, budget: int, shared: bool = False) -> None:
        if budget < 0:
            raise CheckpointError(f"the snapshot budget cannot be negative, got {budget}")
        self.budget = budget
        # shared: the memory is a SharedMemory another process maps (the save process);
        # ``memory`` is the current one, replaced when the arena grows
        self.shared = shared
        self.memory: SharedMemory | None = None
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
        docs/BENCHMARKS.md "The first save: cold memory and `reserve()`"); reserved ahead, the first save copies into ready
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
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if self.shared:
            self.memory = SharedMemory(align_up(nbytes), name="fastpersist-arena")
            buffer = self.memory.tensor
        else:
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
