"""One queued checkpoint: what ``save()`` captured and what the protocol needs to write it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastpersist.handle import Completion, SaveHandle, SaveMetrics

if TYPE_CHECKING:
    from fastpersist import dtensor
    from fastpersist.io.fills import Fill
    from fastpersist.objects.write import Prepared
    from fastpersist.stage import Capture


@dataclass
class SaveJob:
    """A checkpoint from ``save()`` to its commit (or failure).

    ``save()`` fills the first fields; staging (:mod:`fastpersist.stage`) replaces ``state``,
    ``rank_state`` and the shards' tensors by their copies, or leaves them live; the save
    protocol (:mod:`fastpersist.protocol`) pickles them if staging did not.
    """

    step: int
    state: Any  # saveable: state_dicts taken; in the background modes, captured (see stage.py)
    rank_state: Any
    metadata: Mapping[str, Any] | None
    completion: Completion
    started: float
    shards: list[dtensor.LocalShard] = field(default_factory=list)  # this rank's chunks of the DTensors
    uses_arena: bool = False
    live: bool = False  # some tensors are written from live (guarded) memory
    inline: bool = False  # save() waits for the commit: the state was not copied
    number: int = 0  # this Checkpointer's n-th queued save (the same on every rank)
    prepared: tuple[Prepared, Prepared | None] | None = None  # pickled state and rank state
    directory: str | None = None  # save(directory=...): published there after the commit
    fill: Fill | None = None  # the snapshot arena while save() is still copying into it
    capture: Capture | None = None  # the copies save() makes once the job is queued (stage.py)

    @property
    def handle(self) -> SaveHandle:
        return self.completion.handle

    @property
    def metrics(self) -> SaveMetrics:
        return self.completion.handle.metrics
