"""Which committed checkpoints to delete. Pure: the Checkpointer does the deleting.

Policy: keep the last ``keep_last`` committed checkpoints, and also every step that is a
multiple of ``keep_every`` (when set). Never delete the latest committed checkpoint, nor any
step in ``protected`` (checkpoints being written or queued). Incomplete checkpoints are never
this policy's business: they are cleaned at start-up, when no save of this job can be running.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fastpersist.errors import CheckpointError


@dataclass(frozen=True)
class Retention:
    keep_last: int | None = None  # None keeps everything
    keep_every: int | None = None

    def __post_init__(self) -> None:
        if self.keep_last is not None and self.keep_last < 1:
            raise CheckpointError(f"keep must be at least 1 (or None to keep all), got {self.keep_last}")
        if self.keep_every is not None and self.keep_every < 1:
            raise CheckpointError(f"keep_every must be at least 1, got {self.keep_every}")

    def to_delete(self, committed: Sequence[int], latest: int | None, protected: Iterable[int] = ()) -> list[int]:
        """The steps to delete, oldest first, given the committed steps (any order)."""
        if self.keep_last is None:
            return []
        steps = sorted(set(committed))
        keep = set(steps[-self.keep_last :]) | set(protected)
        if latest is not None:
            keep.add(latest)
        if self.keep_every:
            keep |= {s for s in steps if s % self.keep_every == 0}
        return [s for s in steps if s not in keep]
