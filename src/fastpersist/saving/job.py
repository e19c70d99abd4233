"""One queued checkpoint: what ``save()`` captured and what the protocol needs to write it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastpersist.objects import dtensor
from fastpersist.saving.handle import Completion, SaveHandle, SaveMetrics
from fastpersist.state import to_saveable

if TYPE_CHECKING:
    from fastpersist.io.fills import Fill
    from fastpersist.objects.write import Prepared
    from fastpersist.saving.capture import Capture


@dataclass
class SaveJob:
    """A checkpoint from ``save()`` to its commit (or failure).

    ``save()`` fills the first fields; staging (:mod:`fastpersist.saving.stage`) replaces ``state``,
    ``rank_state`` and the shards' tensors by their copies, or leaves them live; the save
    protocol (:mod:`fastpersist.saving.protocol`) pickles them if staging did not.
    """

    step: int
    state: Any  # saveable: state_dicts taken; in the background modes, captured (see capture.py)
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
    capture: Capture | None = None  # the copies save() makes once the job is queued (stage.py, capture.py)
    shipped: int = 0  # the process engine: the number its save process knows it by (saving/remote.py)

    @property
    def handle(self) -> SaveHandle:
        return self.completion.handle

    @property
    def metrics(self) -> SaveMetrics:
        return self.completion.handle.metrics


def new_job(step: int, state: Any, rank_state: Any, meta: Mapping[str, Any] | None, completion: Completion,
            t0: float, split: bool = True) -> SaveJob:
    """A save's job: the state made saveable, its DTensors taken out (their shards; without
    ``split``, left for the process engine's one pass to find, :mod:`fastpersist.saving.ship`)."""
    plain, own, shards = saveable_state(state, rank_state, split)
    return SaveJob(step, plain, own, meta, completion, t0, shards)


def saveable_state(state: Any, rank_state: Any, split: bool = True) -> tuple[Any, Any, list[dtensor.LocalShard]]:
    """(state, rank_state) made saveable, and the state's DTensors' local shards."""
    saveable = to_saveable(state)
    own = to_saveable(rank_state) if rank_state is not None else None
    shards: list[dtensor.LocalShard] = []
    if split and dtensor.dtensor_type() is not None:  # no DTensor exists before its module is loaded
        saveable, shards = dtensor.split(saveable)  # the state itself where it holds none
    if own is not None and dtensor.holds_dtensors(own):
        raise ValueError("rank_state holds DTensors: pass sharded state (DTensors) in `state`; fastpersist "
                         "writes each rank's shards and reshards them at load")
    return saveable, own, shards
