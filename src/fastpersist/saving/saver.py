"""The training thread's side of saving: a save's job built, staged and queued.

``Checkpointer.save`` checks its arguments and hands the rest to a :class:`Saver`: back-pressure
(the driver decides whether the save waits for room or is skipped), the job (the state made
saveable, its DTensors' local shards taken out), staging (copied into the snapshot arena, or
left live: sync mode, guarded tensors, over the arena's budget), the job queued on the one
save driver, the snapshot's copies made while its writes start, and, for a save that runs
inline, the wait for its commit. Everything after the queue (the protocol, its extensions)
runs in the driver's worker.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

from fastpersist.config import IOConfig
from fastpersist.dist import Comm
from fastpersist.errors import CheckpointWriteError
from fastpersist.objects.write import prepare_lanes
from fastpersist.saving.driver import SaveDriver
from fastpersist.saving.guard import OverlapGuard
from fastpersist.saving.handle import Completion, History, SaveHandle, SaveMetrics
from fastpersist.saving.job import SaveJob, new_job, saveable_state
from fastpersist.saving.sharing import SharedLive
from fastpersist.saving.ship import Shipped
from fastpersist.saving.stage import Stager

logger = logging.getLogger(__name__)
# the line each committed save logs: on the logger README documents, the Checkpointer's
summary_logger = logging.getLogger("fastpersist.checkpointer")


class Saver:
    """Saves of one Checkpointer on this rank, up to the driver's queue (see the module).

    ``run(job)`` is the save protocol (called in the driver's worker, in ``save()`` order).
    """

    def __init__(self, run: Callable[[SaveJob], None], comm: Comm, *, mode: str, max_in_flight: int,
                 when_busy: str, snapshot_bytes: int, history: int, config: Callable[[], IOConfig],
                 roots: int, shipped: bool = False) -> None:
        self.mode = mode
        # shipped: every save leaves through the shared arena for the save process (engine="process")
        self.shipped = shipped
        self.driver = SaveDriver(run, self._finished, comm, max_in_flight, when_busy, config().switch_interval_us)
        self.stager = Stager(snapshot_bytes, comm.rank, shared=shipped)
        self.sharing = SharedLive()  # overlap mode with the process engine: tensors moved into shared memory
        self.ship: Callable[[SaveJob, bytes], None] = _unset  # the process engine's: hands a packed job over
        self.guard = OverlapGuard(self.driver.in_flight, self.driver.raise_failed)
        self.history = History(history)  # metrics of recent saves, and totals
        self._config = config
        self._roots = roots

    def _live(self) -> set[int]:
        """The storages written from live memory (overlap mode: the protected optimizers')."""
        return self.guard.storages() if self.mode == "overlap" else set()

    def save(self, step: int, state: Any, rank_state: Any, metadata: Mapping[str, Any] | None,
             directory: str | None, t0: float) -> SaveHandle:
        """Checkpoint ``state`` as ``step`` (arguments checked); see ``Checkpointer.save``."""
        completion = Completion(SaveHandle(SaveMetrics(step, self.mode)))
        if not self.driver.make_room(completion):
            self.history.append(completion.handle.metrics)
            self.driver.raise_failed()
            return completion.handle
        # the process engine's overlap mode moves the protected tensors into shared memory
        # before state_dict() takes views of them (a view taken before would miss the move)
        live = self.sharing.share(self.guard.protected) if self.shipped and self.mode == "overlap" else {}
        job = new_job(step, state, rank_state, metadata, completion, t0, split=not self.shipped)
        job.directory = directory
        if self.shipped:  # packed whole, at once, and sent: the save process holds it before save() returns
            message = self.stager.pack(job, live)
            if message is None:
                completion.finish(CheckpointWriteError(
                    f"checkpoint step {step}: the state does not fit in snapshot_bytes "
                    f"({self.stager.arena.budget} bytes), and engine='process' writes only from the snapshot arena: "
                    "raise snapshot_bytes"))
                completion.mark_reported()
                raise completion.handle.exception()  # type: ignore[misc]
            job.inline = self.mode == "sync"
            try:
                self.ship(job, message)
            except BaseException:
                self.stager.release(job)
                raise
        else:
            job.inline = self.mode == "sync" or not self.stager.stage(job, self._live(), self._config().snapshot_pipeline)
        # Queued on every rank alike (what a rank raises below differs with timing, so it must
        # come after the job is queued: otherwise the ranks' queues would fall out of step).
        try:
            self.driver.submit(job)
            self.stager.copy(job)  # the snapshot's copies, while its writes start (fastpersist.io.fills)
        except BaseException as e:
            if job.fill is not None:  # interrupted or failed before every byte was copied: the
                job.fill.fail(e)  # writer must not wait for them, it fails the job instead
            completion.mark_reported()  # raised here; not raised again by a later call
            raise
        finally:
            if not job.inline and not job.live:
                completion.staged()
        handle = completion.handle
        if not job.inline:
            handle.metrics.save_call_s = time.perf_counter() - t0
            self.driver.raise_failed(besides=completion)  # its writes began during its copies
            return handle
        handle.metrics.inline = True
        try:
            handle.result()  # every earlier save first, then this one: one driver, one order
        finally:
            handle.metrics.save_call_s = time.perf_counter() - t0
            if handle.exception() is None:
                self._log(handle.metrics)
        self.driver.raise_failed()
        return handle

    def reserve(self, state: Any, rank_state: Any, nbytes: int | None) -> Future[int]:
        """Make the memory of the coming saves ready (``state`` sized as ``save()`` would copy
        it, or ``nbytes``); see ``Checkpointer.reserve``."""
        if self.mode == "sync" and not self.shipped:  # sync saves copy nothing
            nbytes = 0
        elif nbytes is None:
            plain, own, shards = saveable_state(state, rank_state)
            nbytes = self.stager.need(plain, own, [sh.tensor for sh in shards], self._live())
        # the staging buffers of one file per root written at once
        return self.stager.reserve(nbytes, functools.partial(prepare_lanes, self._config(), self._roots))

    def save_captured(self, shipped: Shipped, t0: float, staged: Callable[[], None] | None = None) -> SaveHandle:
        """A save the training process captured (the save process, :mod:`fastpersist.save_process`):
        its tensors are views of the shared arena, which nobody changes until this returns;
        written from there, and committed before this returns. Raises its failure."""
        completion = Completion(SaveHandle(SaveMetrics(shipped.step, self.mode)))
        self.driver.make_room(completion)  # one at a time: the training process waits for each
        job = SaveJob(shipped.step, shipped.state, shipped.rank_state, shipped.metadata, completion, t0,
                      shipped.shards, inline=True, prepared=shipped.prepared, directory=shipped.directory)
        job.metrics.inline = True
        job.live = True  # the memory is the training process's: staged once written
        if staged is not None:
            completion.handle.staged.add_done_callback(lambda _: staged())
        self.driver.submit(job)
        completion.handle.result()
        self._log(job.metrics)
        return completion.handle

    def _finished(self, job: SaveJob, error: BaseException | None) -> None:
        self.stager.release(job)
        if error is None and not job.inline:
            self._log(job.metrics)  # an inline job is logged by save(), which timed it

    def _log(self, m: SaveMetrics) -> None:
        self.history.append(m)
        summary_logger.info("%s", m.summary())

    def wait(self, timeout: float | None) -> None:
        self.driver.wait(timeout)

    def close(self) -> None:
        """Stop the worker (after the jobs queued), join the reservations, remove the guards."""
        try:
            self.driver.stop()
            self.stager.arena.join()
        finally:
            self.guard.remove()


def _unset(job: SaveJob, message: bytes) -> None:
    raise CheckpointWriteError("internal: a shipped save with no save process to take it")
