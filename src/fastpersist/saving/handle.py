"""The handle ``Checkpointer.save`` returns, and the metrics of one save.

A :class:`SaveHandle` behaves like a :class:`concurrent.futures.Future` of the committed
checkpoint (``done``, ``result``/``wait``, ``exception``, ``add_done_callback``) and carries a
second future, :attr:`SaveHandle.staged`: the moment training may modify the saved tensors
again (copied out, or, for tensors written from live memory, written). DCP's asynchronous save
separates the same two moments.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fastpersist.errors import CheckpointError

logger = logging.getLogger(__name__)


@dataclass
class SaveMetrics:
    """One save, as a structured record (also logged as one line when it completes).

    ``blocked_s`` is the time training was blocked: inside ``save()`` plus inside guarded
    optimizer steps that waited for this checkpoint.
    """

    step: int
    mode: str
    bytes_total: int = 0  # data bytes in the checkpoint (all objects, all ranks)
    bytes_written: int = 0  # data bytes this rank wrote
    bytes_reused: int = 0  # incremental saves: data bytes this rank linked from the last checkpoint, not written
    bytes_per_root: dict[int, int] = field(default_factory=dict)
    bytes_copied: int = 0  # bytes copied at save time (snapshot / unguarded tensors)
    save_call_s: float = 0.0  # time inside save()
    step_wait_s: float = 0.0  # time guarded optimizer steps waited for this checkpoint
    write_s: float = 0.0  # this rank's data writes (background)
    replica_check_s: float = 0.0  # hashing the replicated bytes for the cross-rank check
    probe_s: float = 0.0  # incremental saves: finding this rank's unchanged units (samples, digests)
    total_s: float = 0.0  # from save() to committed
    waited_for_previous: bool = False  # save() waited for an earlier checkpoint (back-pressure)
    skipped: bool = False  # not taken: the previous checkpoint was still in flight
    inline: bool = False  # save() waited for the commit (sync mode, or over the snapshot budget)
    pipelined: bool = False  # the snapshot's copy overlapped its writes (IOConfig.snapshot_pipeline)
    templated: bool = False  # the state's skeleton was written from the last one's template, not pickled

    @property
    def blocked_s(self) -> float:
        return self.save_call_s + self.step_wait_s

    def summary(self) -> str:
        """The line logged when the checkpoint is committed."""
        rate = self.bytes_total / 2**30 / self.total_s if self.total_s > 0 else 0.0
        return (f"checkpoint step {self.step} committed ({self.mode}{', inline' if self.inline else ''}): "
                f"{self.bytes_total / 2**20:.1f} MiB in {self.total_s:.3f} s ({rate:.2f} GiB/s); training blocked "
                f"{self.blocked_s * 1e3:.1f} ms (save {self.save_call_s * 1e3:.1f} + step {self.step_wait_s * 1e3:.1f}); "
                f"wrote {self.bytes_written / 2**20:.1f} MiB on this rank in {self.write_s:.3f} s"
                + (f" (reused {self.bytes_reused / 2**20:.1f} MiB)" if self.bytes_reused else ""))

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.total_s / 1e9 if self.total_s > 0 else 0.0


class SaveHandle:
    """A checkpoint being saved: a future of its commit, with :attr:`staged` beside it."""

    def __init__(self, metrics: SaveMetrics) -> None:
        self.metrics = metrics
        self.staged: cf.Future[None] = cf.Future()  # training may modify the saved tensors
        # The drain to the durable tier: True once this rank's part is there (rank 0: once the
        # durable copy is committed), False when the step is not drained (no durable tier, not
        # due, the save failed); the drain's error if it failed. Never raised by save/wait.
        self.durable: cf.Future[bool] = cf.Future()
        self._committed: cf.Future[SaveMetrics] = cf.Future()
        self._reported = False  # the error was raised to the caller once already

    @property
    def step(self) -> int:
        return self.metrics.step

    def done(self) -> bool:
        """Whether the checkpoint is committed, failed or skipped."""
        return self._committed.done()

    def result(self, timeout: float | None = None) -> SaveMetrics:
        """Wait until the checkpoint is committed and return its metrics; raises its error."""
        try:
            return self._committed.result(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"checkpoint step {self.step} is not committed after {timeout} s") from None
        except BaseException:
            self._reported = True
            raise

    wait = result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The checkpoint's error (None if it committed); waits like :meth:`result`."""
        try:
            return self._committed.exception(timeout)
        except cf.TimeoutError:
            raise TimeoutError(f"checkpoint step {self.step} is not committed after {timeout} s") from None

    def add_done_callback(self, fn: Callable[[SaveHandle], object]) -> None:
        """Call ``fn(handle)`` once the checkpoint is committed or failed (at once if it is).

        Callbacks run in the Checkpointer's save thread, before the next save starts: keep them
        short, and never call ``save()``, ``wait()`` or ``close()`` of the same Checkpointer
        from one (they would wait for the thread that runs them). An exception in one is
        logged."""
        def call(_: cf.Future[SaveMetrics]) -> None:
            try:
                fn(self)
            except Exception:  # noqa: BLE001 - a user callback must not kill the save driver
                logger.exception("a done-callback of checkpoint step %d raised", self.step)

        self._committed.add_done_callback(call)

    @property
    def reported(self) -> bool:
        """Whether this checkpoint's error was raised to the caller already."""
        return self._reported


class Completion:
    """The save driver's side of a :class:`SaveHandle`: the only code that completes it.

    A handle's readers (training, callbacks, tests) can wait on it but never complete it; the
    job that owns the handle holds its Completion and marks the two moments, staged and done.
    """

    def __init__(self, handle: SaveHandle) -> None:
        self.handle = handle
        self._draining = False

    def staged(self) -> None:
        """Training may modify the saved tensors again (idempotent; ``save()`` and the writer
        may both say so, from two threads)."""
        try:
            self.handle.staged.set_result(None)
        except cf.InvalidStateError:  # already said
            pass

    def finish(self, error: BaseException | None = None) -> None:
        """The checkpoint is committed (``error`` None), failed or skipped. Anything that is
        not a :class:`CheckpointError` is wrapped in one naming the step."""
        handle = self.handle
        if error is not None and not isinstance(error, CheckpointError):
            wrapped = CheckpointError(f"checkpoint step {handle.step} failed: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self.staged()
        if not self._draining:  # a drain in flight completes the durable future itself
            self.not_drained()
        if error is None:
            handle._committed.set_result(handle.metrics)
        else:
            handle._committed.set_exception(error)

    def draining(self) -> cf.Future[bool]:
        """The durable tier takes this checkpoint: the future it completes when the drain ends
        (without this, a committed checkpoint's ``handle.durable`` is False)."""
        self._draining = True
        return self.handle.durable

    def not_drained(self) -> None:
        """This checkpoint will not be drained to the durable tier (idempotent)."""
        if not self.handle.durable.done():
            self.handle.durable.set_result(False)

    @property
    def error(self) -> BaseException | None:
        """The checkpoint's error once it is done (None if it committed or is not done)."""
        committed = self.handle._committed
        return committed.exception() if committed.done() else None

    def mark_reported(self) -> None:
        """The caller has this save's failure already (``save()`` raised it): the job's own
        error, when it ends, is not raised to the caller a second time."""
        self.handle._reported = True

    def take_error(self) -> BaseException | None:
        """The error, marked as raised to the caller: None if there is none or it was raised."""
        if self.handle._reported:
            return None
        self.handle._reported = True
        return self.error


class History:
    """The metrics of recent saves (bounded: a job may save every iteration for weeks) and
    running totals over every save since the Checkpointer was built.

    Iterating or indexing gives the recent :class:`SaveMetrics`, oldest first.
    """

    def __init__(self, recent: int = 1000) -> None:
        self._recent: collections.deque[SaveMetrics] = collections.deque(maxlen=recent)
        self.saves = 0  # committed saves
        self.skipped = 0
        self.bytes_total = 0
        self.blocked_s = 0.0
        self.max_blocked_s = 0.0
        self.total_s = 0.0

    def append(self, m: SaveMetrics) -> None:
        self._recent.append(m)
        if m.skipped:
            self.skipped += 1
            return
        self.saves += 1
        self.bytes_total += m.bytes_total
        self.blocked_s += m.blocked_s
        self.max_blocked_s = max(self.max_blocked_s, m.blocked_s)
        self.total_s += m.total_s

    def __iter__(self) -> Iterator[SaveMetrics]:
        return iter(list(self._recent))

    def __len__(self) -> int:
        return len(self._recent)

    def __getitem__(self, i: int) -> SaveMetrics:
        return self._recent[i]

    @property
    def mean_blocked_s(self) -> float:
        return self.blocked_s / self.saves if self.saves else 0.0
