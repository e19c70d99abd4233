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

import logging
import pickle
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch

from fastpersist.errors import CheckpointError
from fastpersist.format import manifest as mf
from fastpersist.io.buffers import align_up
from fastpersist.io.fills import Fill
from fastpersist.objects import dtensor
from fastpersist.objects.write import Prepared, prepare
from fastpersist.saving.arena import Arena
from fastpersist.saving.capture import Capture, copy_bytes, scan
from fastpersist.saving.job import SaveJob
from fastpersist.saving.ship import HoldsDTensors, NotPlain, Shipped, encode

logger = logging.getLogger(__name__)


class Stager:
    """Makes a job independent of training from ``save()`` on, except for guarded tensors.

    Plain states (containers, tensors, immutable values) are captured structurally and pickled
    in the background; anything else is pickled at once. Unguarded storages are copied into the
    arena; :meth:`stage` returns False when they do not fit (the save then runs inline, from
    live memory, through the fixed staging pool).
    """

    def __init__(self, budget: int, rank: int, shared: bool = False) -> None:
        self.arena = Arena(budget, shared)
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

    def pack(self, job: SaveJob, live: Mapping[int, tuple[Any, int]]) -> bytes | None:
        """The process engine's staging: the job as the message for its save process
        (:mod:`fastpersist.saving.ship`), pickled in one pass over the state that places every
        storage: in its region of shared memory when it is in ``live`` (storage address -> the
        region's name and base), else at the next offset of the shared arena, where it is then
        copied. A state the save process might not rebuild is pickled here first, as the thread
        engine pickles it (:meth:`_storages`), and only its skeleton and storages are shipped.
        None when the copies would not fit the arena's budget."""
        def shipped(with_state: bool) -> Shipped:
            state, own = (job.state, job.rank_state) if with_state else (None, None)
            return Shipped(job.step, state, own, job.shards, job.prepared, job.metadata, job.directory)

        try:
            try:
                enc = encode(shipped(True), live, strict=True)
            except HoldsDTensors:  # found by this pass: a state without them is walked once
                job.state, job.shards = dtensor.split(job.state)
                enc = encode(shipped(True), live, strict=True)
        except (NotPlain, pickle.PicklingError, AttributeError, TypeError):  # pickled as the thread engine
            if not job.shards and dtensor.dtensor_type() is not None:  # maybe met before a DTensor
                job.state, job.shards = dtensor.split(job.state)
            job.prepared = self._prepare(job.state, job.rank_state)
            enc = encode(shipped(False), live, strict=False)
        if not self.arena.fits(enc.pos):
            return None
        arena = self.arena.take(enc.pos) if enc.pos else None
        job.uses_arena = arena is not None
        try:
            cap = Capture(set(), arena)
            for pos, storage in enc.pending:  # in the order the pass placed them: the same offsets
                cap.storage(storage)
                if cap.pos - align_up(storage.nbytes()) != pos:
                    raise CheckpointError(f"internal: a storage placed at {pos} of the arena was copied elsewhere")
            cap.finish()
        except BaseException:
            self.release(job)
            raise
        job.live = enc.live_used
        job.metrics.bytes_copied = cap.copied
        return enc.message  # type: ignore[attr-defined,no-any-return]

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
        rep, own = self._prepare(state, rank_state)
        return rep.storages + (own.storages if own else []) + shard_storages, (rep, own)

    def _prepare(self, state: Any, rank_state: Any) -> tuple[Prepared, Prepared | None]:
        """The state and rank state pickled now (their skeletons), their storages left to capture."""
        rep = prepare(mf.REPLICATED, state)
        own = prepare(mf.rank_object(self.rank), rank_state) if rank_state is not None else None
        return rep, own

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
