"""The save protocol: the steps every rank runs for one checkpoint, and the messages they send.

On every rank (each numbered step is one :func:`fastpersist.dist.agree`, so a failure anywhere
raises everywhere and nobody waits in a collective the others skipped):

1. (all ranks) serialize the state locally; compute the plan; send a :class:`Proposal`: the
   plan's digest (covering the storages' sizes and the skeleton), a save id (the coordinator's
   is used), the step and this save's number (ranks out of step are caught), this rank's
   DTensor chunks. Rank 0 first takes the roots' lock and cleans up after a crashed run.
2. (all ranks) write (:class:`~fastpersist.rank_writer.RankWriter`): every file fsync'd, then
   the directories; each rank sends a :class:`RankReport` of what it wrote. The ranks then
   check that the replicated state is replicated (digests taken beside the writes).
3. (coordinator) commit (:class:`~fastpersist.coordinator.Coordinator`): the manifest built
   from every rank's report is written last, atomically and durably; then ``latest``.

After the commit, a step due for the durable tier is queued for each rank's drain thread
(:mod:`fastpersist.durable.drain`: no collective, nothing waits for it).

If step 2 or 3 fails anywhere, no manifest exists, ``latest`` is unchanged, and each rank removes
the files it wrote for this save id. After the commit the coordinator removes files of an
earlier save of the same step and applies retention (best effort: never fails the save).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastpersist import catalog, dtensor
from fastpersist.dist import Comm, agree
from fastpersist.durable.drain import Drainer, drain_files
from fastpersist.errors import CheckpointError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.job import SaveJob
from fastpersist.objects.write import FileReport, Prepared, prepare
from fastpersist.plan import Extent, plan, plan_digest
from fastpersist.replicas import check_replicas, check_replicated_chunks

if TYPE_CHECKING:
    from fastpersist.coordinator import Coordinator
    from fastpersist.rank_writer import RankWriter

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Proposal:
    """Step 1's message: what one rank is about to save."""

    digest: str  # of the plan: storages' sizes, slots and the skeleton
    save_id: str  # the coordinator's is used by everyone
    step: int
    number: int  # this Checkpointer's n-th save on that rank
    chunks: list[dtensor.ChunkMeta]  # this rank's DTensor chunks


@dataclass
class RankReport:
    """Step 2's message: what one rank wrote, for the coordinator's manifest."""

    reports: list[FileReport]
    objects: dict[str, tuple[list[str], list[int], list[mf.TensorEntry]]]  # objects whose skeleton this rank wrote
    digests: list[int] | None = None  # per replicated storage, for the replica check
    chunk_digests: dict[int, int] = field(default_factory=dict)  # replicated shards held here


@dataclass(frozen=True)
class SavePlan:
    """What every rank agreed to write for one checkpoint."""

    step: int
    directory: str  # the checkpoint's directory name in every root
    save_id: str
    slots: list[tuple[int, int]]  # (writer rank, root) of each replicated-state slot
    extents: list[Extent]  # the replicated bytes over the slots
    layout: dtensor.Layout  # who writes which DTensor chunk
    replicated: Prepared
    own: Prepared | None


class SaveProtocol:
    """Runs the protocol for one job at a time (in the save driver's worker, or inline)."""

    def __init__(self, comm: Comm, writer: RankWriter, coordinator: Coordinator, writer_ranks: list[int],
                 roots: int, check_replicated: bool, in_flight: Callable[[], set[int]],
                 drainer: Drainer | None = None) -> None:
        self.comm = comm
        self.drainer = drainer  # the durable tier's, if there is one
        self._taken: int | None = None  # rank 0: the step its drain took in this save's commit
        if drainer is not None and comm.rank == 0:  # a local copy a drain held back may go when it ends
            drainer.ended = lambda: coordinator.retain(in_flight() | drainer.pending())
        self._in_flight = in_flight  # the steps of the jobs in flight (retention spares them)
        self.writer = writer
        self.coordinator = coordinator
        self.slots = [(r, j) for r in writer_ranks for j in range(roots)]
        self.check_replicated = check_replicated and comm.world_size > 1
        self.broken: str | None = None  # set on every rank alike when the ranks fell out of step

    @property
    def rank(self) -> int:
        return self.comm.rank

    def run(self, job: SaveJob) -> None:
        if self.broken is not None:  # no collective: the other ranks stopped too
            job.completion.staged()
            raise CheckpointWriteError(self.broken)
        try:
            proposals = agree(self.comm, f"preparing checkpoint step {job.step}", lambda: self._propose(job))
            p = self._plan(job, proposals)
        except BaseException:
            job.completion.staged()
            raise
        self._taken = None
        try:
            written = agree(self.comm, f"writing checkpoint step {job.step}", lambda: self.writer.write(job, p))
            if self.check_replicated:
                check_replicas(job.step, [w.digests for w in written], p.replicated, job.state)
                check_replicated_chunks(job.step, [w.chunk_digests for w in written], [c.key for c in p.layout.chunks])
            drain = agree(self.comm, f"committing checkpoint step {job.step}",
                          lambda: self._commit(job, p, written) if self.rank == 0 else None)[0]
        except CheckpointError:
            if self.drainer is not None and self._taken == job.step:
                self.drainer.forget(job.step)  # rank 0 took it, then the commit failed somewhere: never queued
            if not self.coordinator.is_committed(job.step, p.save_id):  # after the commit point, files stay
                catalog.remove_files(self.writer.roots, job.step, f"{p.save_id}-", self.writer.backend, prune=True)
            raise
        self._account(job, written)
        try:
            self._drain(job, p, written, bool(drain))
        except Exception as e:  # noqa: BLE001 - committed: the durable tier must not fail the save
            logger.warning("checkpoint step %d is committed; queueing its drain failed: %s", job.step, e)
            job.completion.not_drained()
        if self.rank == 0:
            try:
                pending = self.drainer.pending() if self.drainer is not None else set()
                self.coordinator.after_commit(job.step, written, self._in_flight() | pending)
            except Exception as e:  # noqa: BLE001 - committed: a cleanup failure must not fail the save
                logger.warning("checkpoint step %d is committed; cleaning up after it failed: %s", job.step, e)

    def _commit(self, job: SaveJob, p: SavePlan, written: list[RankReport]) -> bool:
        """Step 3 on rank 0; returns whether the step is drained to the durable tier, which
        rank 0 alone decides (its drain ends only when every rank's part is up, so its queue
        bounds everyone's) and every rank learns from this step's all-gather. A step to drain
        is marked first, so that retention and the drain's clean-up spare it from the moment
        any rank can learn of its commit."""
        drain = self.drainer is not None and self.drainer.take(job.step)
        self._taken = job.step if drain else None
        self.coordinator.commit(job.step, p.save_id, written, job.metadata, p.layout)
        return drain

    def _drain(self, job: SaveJob, p: SavePlan, written: list[RankReport], drain: bool) -> None:
        """After the commit, on every rank: queue this rank's part of the drain, if rank 0 said so."""
        if self.drainer is None or not drain:
            job.completion.not_drained()
            return
        writers = [r for r, w in enumerate(written) if w.reports]
        self.drainer.submit(job.step, p.save_id, drain_files(written[self.rank].reports), writers,
                            job.completion.handle.durable)

    def _propose(self, job: SaveJob) -> Proposal:
        """Step 1 on this rank: serialize the state (unless staging did), propose."""
        if job.prepared is None:
            rep = prepare(mf.REPLICATED, job.state)
            own = prepare(mf.rank_object(self.rank), job.rank_state) if job.rank_state is not None else None
            job.prepared = (rep, own)
        rep = job.prepared[0]
        digest = plan_digest(rep.sizes, len(self.slots), extra=rep.skeleton_checksum.to_bytes(8, "big"))
        if self.rank == 0:
            self.coordinator.start(job.step)
        return Proposal(digest, secrets.token_hex(6), job.step, job.number, [sh.meta for sh in job.shards])

    def _plan(self, job: SaveJob, proposals: list[Proposal]) -> SavePlan:
        """The plan every rank derives alike from the proposals; or, on every rank alike, why not."""
        first = proposals[0]
        out_of_step = [r for r, x in enumerate(proposals) if (x.step, x.number) != (first.step, first.number)]
        if out_of_step:  # every rank sees it in the same step: all stop issuing collectives
            other = proposals[out_of_step[0]]
            self.broken = (
                f"the ranks are out of step: rank 0 is saving step {first.step} (its save #{first.number}) "
                f"while rank {out_of_step[0]} is saving step {other.step} (its save #{other.number}). Every rank "
                "must call save() with the same steps in the same order, and an exception raised by save() on "
                "one rank only (a bad argument) leaves that rank one save behind; this Checkpointer takes no "
                "more saves (nothing further is committed): restart the job's Checkpointers"
            )
            raise CheckpointWriteError(self.broken)
        differing = [r for r, x in enumerate(proposals) if x.digest != first.digest]
        if differing:
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: the replicated state differs between ranks: ranks {differing} disagree "
                "with rank 0 on its structure (the keys, the tensors' sizes and dtypes, or the pickled values). "
                "`state` is written once for all ranks and must be the same on each; pass per-rank values "
                "(an optimizer shard, ZeRO/FSDP state) as rank_state"
            )
        rep, own = job.prepared  # type: ignore[misc]
        return SavePlan(job.step, catalog.step_dir(job.step), first.save_id, self.slots,
                        plan(rep.sizes, len(self.slots)), dtensor.assign([x.chunks for x in proposals]), rep, own)

    def _account(self, job: SaveJob, written: list[RankReport]) -> None:
        m = job.metrics
        for r in written[self.rank].reports:
            m.bytes_per_root[r.root] = m.bytes_per_root.get(r.root, 0) + sum(e.nbytes for e in r.extents)
        m.bytes_written = sum(m.bytes_per_root.values())
        m.bytes_total = sum(e.nbytes for w in written for r in w.reports for e in r.extents)
