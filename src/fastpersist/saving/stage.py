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
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from fastpersist.format import manifest as mf
from fastpersist.io.fills import Fill
from fastpersist.objects.write import Prepared, prepare
from fastpersist.saving.arena import Arena
from fastpersist.saving.capture import Capture, copy_bytes, scan
from fastpersist.saving.job import SaveJob

logger = logging.getLogger(__name__)


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
