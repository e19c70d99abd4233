"""The save driver: one queue, one worker thread, back-pressure and failures.

``save()`` hands every checkpoint to :meth:`SaveDriver.submit`; one worker thread runs the save
protocol for each job in submission order, whatever the mode, so commit order equals ``save()``
order on every rank and one thread issues the protocol's collectives. At most
``max_in_flight`` jobs are pending at once: beyond that :meth:`SaveDriver.make_room` waits, or
skips the checkpoint (every rank deciding alike). A job that fails in the background is kept
until its error has been raised to the caller once (by :meth:`raise_failed`: the next
``save()``, ``wait()``, a guarded optimizer step or ``close()``).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from fastpersist.saving import gil
from fastpersist.dist import Comm
from fastpersist.saving.handle import Completion
from fastpersist.saving.job import SaveJob

logger = logging.getLogger(__name__)

WHEN_BUSY = ("wait", "skip")


class SaveDriver:
    """Runs ``run(job)`` for every submitted job, in order, in one worker thread.

    ``done(job, error)`` is called in the worker after each job, before its handle completes
    (releasing its staging memory, logging its metrics).
    """

    def __init__(self, run: Callable[[SaveJob], None], done: Callable[[SaveJob, BaseException | None], None],
                 comm: Comm, max_in_flight: int = 1, when_busy: str = "wait", switch_interval_us: int = 0) -> None:
        if when_busy not in WHEN_BUSY:
            raise ValueError(f"when_busy must be one of {WHEN_BUSY}, got {when_busy!r}")
        self._run = run
        self._done = done
        self._comm = comm
        self.max_in_flight = max_in_flight
        self.when_busy = when_busy
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified when a job leaves the in-flight list
        self._queued = 0
        self._in_flight: list[SaveJob] = []
        self._failed: list[Completion] = []
        self._queue: queue.Queue[SaveJob | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._switch_us = switch_interval_us

    @property
    def running(self) -> bool:
        """Whether the worker thread exists (a job was submitted since the last close)."""
        return self._worker is not None

    def in_flight(self) -> list[SaveJob]:
        """The jobs submitted and not yet finished, oldest first."""
        with self._lock:
            return list(self._in_flight)

    def steps(self) -> set[int]:
        """The steps of the jobs submitted and not yet finished (retention spares them)."""
        with self._lock:
            return {job.step for job in self._in_flight}

    def make_room(self, completion: Completion) -> bool:
        """Back-pressure before a new job: False if the checkpoint is skipped (its handle is
        then finished). Every rank calls it, in the same order."""
        with self._lock:
            busy = len(self._in_flight) >= self.max_in_flight
        if self.when_busy == "skip" and self._comm.world_size > 1:  # every rank must skip alike
            busy = any(self._comm.all_gather(busy, channel="control"))
        if not busy:
            return True
        metrics = completion.handle.metrics
        if self.when_busy == "skip":
            metrics.skipped = True
            completion.not_drained()
            completion.finish()
            logger.info("checkpoint step %d skipped: %d still in flight", metrics.step, self.max_in_flight)
            return False
        metrics.waited_for_previous = True
        logger.debug("checkpoint step %d waits for room: %d still in flight", metrics.step, self.max_in_flight)
        with self._room:
            self._room.wait_for(lambda: len(self._in_flight) < self.max_in_flight)
        return True

    def submit(self, job: SaveJob) -> None:
        """Queue ``job``; the worker starts on it at once (nothing here may take time)."""
        with self._lock:
            self._in_flight.append(job)
            self._queued += 1
            job.number = self._queued
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._work, name="fastpersist-save", daemon=True)
            self._worker.start()
        self._queue.put(job)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            error: BaseException | None = None
            try:
                # a background job shares the GIL with training in short turns (fastpersist.saving.gil)
                with gil.shared(0 if job.inline else self._switch_us):
                    self._run(job)
            except BaseException as e:  # noqa: BLE001 - reported through the handle
                error = e
            self._done(job, error)
            with self._lock:
                if error is not None and not job.inline:
                    self._failed.append(job.completion)
            # A failure is raised to the caller (by wait(), the next save(), a guarded step or
            # close()), never also logged at ERROR; only one nobody collects is (at exit).
            logger.debug("checkpoint step %d finished: %s", job.step, "ok" if error is None else error)
            job.completion.finish(error)  # done (and its callbacks run) before it leaves the in-flight list
            with self._room:
                self._in_flight.remove(job)
                self._room.notify_all()

    def raise_failed(self, besides: Completion | None = None) -> None:
        """Raise the oldest background failure not yet raised to the caller (the others stay
        pending, for the next call). ``besides``: a save whose own failure is left for its
        handle and the next call (``save()`` raises earlier saves' failures, not its own)."""
        with self._lock:
            kept = [c for c in self._failed if c is besides]
            self._failed = [c for c in self._failed if c is not besides]
            try:
                while self._failed:
                    error = self._failed.pop(0).take_error()
                    if error is not None:
                        break
                else:
                    return
            finally:
                self._failed.extend(kept)  # the newest: it was just queued
        raise error

    def wait(self, timeout: float | None = None) -> None:
        """Wait until no job is in flight (TimeoutError naming the oldest after ``timeout``)."""
        with self._room:
            if not self._room.wait_for(lambda: not self._in_flight, timeout):
                step = self._in_flight[0].step
                raise TimeoutError(f"checkpoint step {step} is still in flight after {timeout} s")

    def stop(self) -> None:
        """Stop the worker thread after the jobs queued before (idempotent; a later submit
        starts a new one)."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None
