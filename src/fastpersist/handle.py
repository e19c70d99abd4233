"""The handle ``Checkpointer.save`` returns, and the metrics of one save."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from fastpersist.errors import CheckpointError


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
    bytes_per_root: dict[int, int] = field(default_factory=dict)
    bytes_copied: int = 0  # bytes copied at save time (snapshot / unguarded tensors)
    save_call_s: float = 0.0  # time inside save()
    step_wait_s: float = 0.0  # time guarded optimizer steps waited for this checkpoint
    write_s: float = 0.0  # this rank's data writes (background)
    total_s: float = 0.0  # from save() to committed
    waited_for_previous: bool = False  # save() waited for an earlier checkpoint (back-pressure)
    skipped: bool = False  # not taken: the previous checkpoint was still in flight

    @property
    def blocked_s(self) -> float:
        return self.save_call_s + self.step_wait_s

    @property
    def gbps(self) -> float:
        return self.bytes_total / self.total_s / 1e9 if self.total_s > 0 else 0.0


class SaveHandle:
    """A checkpoint being saved in the background."""

    def __init__(self, metrics: SaveMetrics) -> None:
        self.metrics = metrics
        self._done = threading.Event()
        self._data_written = threading.Event()  # this rank's live tensors are written
        self._error: BaseException | None = None
        self.reported = False  # the error was raised to the caller once already

    @property
    def step(self) -> int:
        return self.metrics.step

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> SaveMetrics:
        """Wait until the checkpoint is committed; raises its error if it failed."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} is not committed after {timeout} s")
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.metrics

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"checkpoint step {self.step} is not committed after {timeout} s")
        return self._error

    # called by the Checkpointer
    def _finish(self, error: BaseException | None = None) -> None:
        if error is not None and not isinstance(error, CheckpointError):
            wrapped = CheckpointError(f"checkpoint step {self.step} failed: {type(error).__name__}: {error}")
            wrapped.__cause__ = error
            error = wrapped
        self._error = error
        self._data_written.set()
        self._done.set()

    def _wait_data_written(self) -> None:
        self._data_written.wait()
