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
   from every rank's report is written last, atomically and durably; then ``latest``. On
   several nodes (node-local roots) this is two steps: rank 0 decides the commit's sequence
   and what retention keeps, then every node's leader writes the same manifest on its node.

After the commit, a step due for the durable tier is queued for each rank's drain thread
(:mod:`fastpersist.durable.drain`: no collective, nothing waits for it).

If step 2 or 3 fails anywhere, no manifest exists, ``latest`` is unchanged, and each rank removes
the files it wrote for this save id. After the commit the coordinator removes files of an
earlier save of the same step and applies retention (best effort: never fails the save).
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fastpersist import catalog, dtensor, timeline
from fastpersist.dist import Comm, agree
from fastpersist.durable.drain import Drainer, drain_files
from fastpersist.errors import CheckpointError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.format.template import Templates
from fastpersist.job import SaveJob
from fastpersist.nodes import Nodes, redundant_plan
from fastpersist.objects.write import FileReport, Prepared, prepare
from fastpersist.plan import Extent, plan_digest
from fastpersist.replicas import check_replicas, check_replicated_chunks

if TYPE_CHECKING:
    from fastpersist.coordinator import Coordinator, Decision
    from fastpersist.incremental import ChunkKey, Incremental, Reused
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
    # several nodes, first save, a node's leader: what its node's roots hold committed
    commits: dict[int, timeline.Commit] | None = None
    own: tuple[int, list[int]] | None = None  # several nodes: its rank_state's skeleton length and storage sizes
    publish: bool = False  # save(directory=...) on this rank
    unchanged: tuple[int, ...] = ()  # incremental saves: this rank's units unchanged since the last commit
    unchanged_chunks: tuple[ChunkKey, ...] = ()  # and the DTensor chunks it holds that are unchanged
    incremental: int = 0  # its Checkpointer's incremental unit size (0: off); the ranks must agree


@dataclass
class RankReport:
    """Step 2's message: what one rank wrote, for the coordinator's manifest."""

    reports: list[FileReport]
    objects: dict[str, tuple[list[str], list[int], list[mf.TensorEntry]]]  # objects whose skeleton this rank wrote
    digests: list[int] | None = None  # per replicated storage, for the replica check
    chunk_digests: dict[int, int] = field(default_factory=dict)  # replicated shards held here
    links_refused: str | None = None  # incremental saves: why this rank's filesystem refused a hard link


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
    multi_node: bool = False  # several nodes: each node's leader writes its copy of the skeleton
    owns: list[tuple[int, list[int]] | None] = field(default_factory=list)  # every rank's Proposal.own
    reused: list[Reused] = field(default_factory=list)  # incremental saves: the last checkpoint's files to link


class SaveProtocol:
    """Runs the protocol for one job at a time (in the save driver's worker, or inline)."""

    def __init__(self, comm: Comm, writer: RankWriter, coordinator: Coordinator, writer_ranks: list[int],
                 roots: int, check_replicated: bool, in_flight: Callable[[], set[int]],
                 drainer: Drainer | None = None, nodes: Nodes | None = None, redundancy: int = 1,
                 incremental: Incremental | None = None) -> None:
        self.comm = comm
        self.incremental = incremental  # skips the replicated bytes unchanged since the last commit
        self.templates = Templates()  # skeletons of structures saved before, written without pickling
        self.nodes = nodes if nodes is not None and nodes.count > 1 else None
        self.redundancy = redundancy
        self._inventoried = False  # several nodes: the leaders' commits were gathered (first save)
        self.drainer = drainer  # the durable tier's, if there is one
        self._taken: int | None = None  # rank 0: the step its drain took in this save's commit
        if drainer is not None and comm.rank == 0:  # a local copy a drain held back may go when it ends
            drainer.ended = lambda: coordinator.retain(in_flight() | drainer.pending())
        self._in_flight = in_flight  # the steps of the jobs in flight (retention spares them)
        self.writer = writer
        self.coordinator = coordinator
        self.slots = [(r, j) for r in writer_ranks for j in range(roots)]
        self.slot_nodes = [self.nodes.of_rank[r] if self.nodes is not None else 0 for r, _ in self.slots]
        self.check_replicated = check_replicated and comm.world_size > 1
        self.broken: str | None = None  # set on every rank alike when the ranks fell out of step

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its node's roots (on one node: rank 0)."""
        return self.nodes.is_leader(self.rank) if self.nodes is not None else self.rank == 0

    def run(self, job: SaveJob) -> None:
        if self.broken is not None:  # no collective: the other ranks stopped too
            job.completion.staged()
            raise CheckpointWriteError(self.broken)
        try:
            if self.nodes is not None and not self._inventoried:
                self._check_roots_are_local(job.step)
            proposals = agree(self.comm, f"preparing checkpoint step {job.step}", lambda: self._propose(job))
            p = self._plan(job, proposals)
            if self.nodes is not None and not self._inventoried:  # every node cleaned before anyone writes
                agree(self.comm, f"preparing checkpoint step {job.step} (cleaning every node's roots)",
                      lambda: self._adopt(proposals))
        except BaseException:
            job.completion.staged()
            raise
        self._taken = None
        phase = "data"
        decision: Decision | None = None
        try:
            written = agree(self.comm, f"writing checkpoint step {job.step}", lambda: self.writer.write(job, p))
            if self.check_replicated:
                check_replicas(job.step, [w.digests for w in written], p.replicated, job.state)
                check_replicated_chunks(job.step, [w.chunk_digests for w in written], [c.key for c in p.layout.chunks])
            decided = agree(self.comm, f"committing checkpoint step {job.step}",
                            lambda: self._commit(job, p, written) if self.rank == 0 else None)[0]
            drain, decision = decided if isinstance(decided, tuple) else (bool(decided), None)
            if decision is not None:
                phase = "nodes"
                agree(self.comm, f"committing checkpoint step {job.step} on every node", lambda: self.coordinator.
                      commit_node(job.step, p.save_id, written, p.layout, decision) if self.leader
                      else None)
        except CheckpointError:
            if self.incremental is not None:
                self.incremental.forget()
            if self.drainer is not None and self._taken == job.step:
                self.drainer.forget(job.step)  # rank 0 took it, then the commit failed somewhere: never queued
            if not self._committed(job.step, p.save_id, phase == "nodes"):  # after the commit point, files stay
                catalog.remove_files(self.writer.roots, job.step, f"{p.save_id}-", self.writer.backend, prune=True)
            elif phase == "nodes" and self.rank == 0 and decision is not None:
                self.coordinator.record(job.step, decision)
            raise
        self._account(job, written)
        if self.incremental is not None:  # a checkpoint moved out of the roots is no reference
            refused = next((w.links_refused for w in written if w.links_refused), None)
            if refused is not None:
                self.incremental.disable(refused)
            elif job.directory is None:
                self.incremental.committed(p.directory, p.replicated.sizes, p.layout, written)
            else:
                self.incremental.forget()
        try:
            self._drain(job, p, written, bool(drain))
        except Exception as e:  # noqa: BLE001 - committed: the durable tier must not fail the save
            logger.warning("checkpoint step %d is committed; queueing its drain failed: %s", job.step, e)
            job.completion.not_drained()
        if job.directory is not None:  # moved out of the roots next: retention must not count it
            self.coordinator.release(job.step)
        if self.leader:
            try:
                pending = self.drainer.pending() if self.drainer is not None else set()
                self.coordinator.after_commit(job.step, written, self._in_flight() | pending, decision)
            except Exception as e:  # noqa: BLE001 - committed: a cleanup failure must not fail the save
                logger.warning("checkpoint step %d is committed; cleaning up after it failed: %s", job.step, e)

    def _committed(self, step: int, save_id: str, on_nodes: bool) -> bool:
        """After a failure: whether this save is committed (its files must stay). When the
        nodes' commit failed on some, it is committed if any node wrote its manifest (every
        rank hears which; a rank that cannot ask keeps its files: a later start removes them
        if no node committed the step)."""
        here = self.coordinator.is_committed(step, save_id)
        if not on_nodes:
            return here
        try:
            return any(self.comm.all_gather(here))
        except CheckpointError:
            return True

    def _commit(self, job: SaveJob, p: SavePlan, written: list[RankReport]) -> bool | tuple[bool, Decision]:
        """Step 3 on rank 0; returns whether the step is drained to the durable tier, which
        rank 0 alone decides (its drain ends only when every rank's part is up, so its queue
        bounds everyone's) and every rank learns from this step's all-gather. A step to drain
        is marked first, so that retention and the drain's clean-up spare it from the moment
        any rank can learn of its commit. On several nodes rank 0 only decides (the nodes'
        leaders commit next)."""
        drain = self.drainer is not None and self.drainer.take(job.step)
        self._taken = job.step if drain else None
        if self.nodes is not None:
            pending = self.drainer.pending() if self.drainer is not None else set()
            return drain, self.coordinator.decide(job.step, job.metadata, self._in_flight() | pending)
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
            rep = prepare(mf.REPLICATED, job.state, self.templates)
            own = (prepare(mf.rank_object(self.rank), job.rank_state, self.templates)
                   if job.rank_state is not None else None)
            job.prepared = (rep, own)
        rep = job.prepared[0]
        extra = rep.skeleton_checksum.to_bytes(8, "big") + f"|{self.redundancy}|{self.slot_nodes}".encode()
        digest = plan_digest(rep.sizes, len(self.slots), extra=extra)
        commits = None
        if self.leader:
            self.coordinator.start(job.step)
            if self.nodes is not None and not self._inventoried:
                commits = self.coordinator.local_commits()
        own = job.prepared[1]
        unique = (len(own.skeleton), own.sizes) if own is not None and self.nodes is not None else None
        unchanged: tuple[list[int], list[ChunkKey]] = ([], [])
        # a directory save is no reference for the next save: hashed only if it can reuse
        inc = self.incremental
        if inc is not None and not inc.disabled and (job.directory is None or inc.has_reference):
            t0 = time.perf_counter()
            unchanged = inc.probe(rep, job.shards)
            job.metrics.probe_s = time.perf_counter() - t0
        return Proposal(digest, secrets.token_hex(6), job.step, job.number, [sh.meta for sh in job.shards], commits,
                        unique, job.directory is not None, tuple(unchanged[0]), tuple(unchanged[1]),
                        self.incremental.block if self.incremental is not None else 0)

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
        publishing = [r for r, x in enumerate(proposals) if x.publish]
        if publishing and len(publishing) != len(proposals):
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: save(directory=...) was given on rank(s) {publishing} only; every rank "
                "passes it (rank 0's directory is used)")
        mixed = [r for r, x in enumerate(proposals) if x.incremental != first.incremental]
        if mixed:
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: the ranks' Checkpointers disagree on incremental=: rank {mixed[0]} uses "
                f"{proposals[mixed[0]].incremental or 'off'}, rank 0 {first.incremental or 'off'} (unit bytes); every "
                "rank constructs its Checkpointer with the same arguments")
        differing = [r for r, x in enumerate(proposals) if x.digest != first.digest]
        if differing:
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: the replicated state differs between ranks: ranks {differing} disagree "
                "with rank 0 on its structure (the keys, the tensors' sizes and dtypes, or the pickled values). "
                "`state` is written once for all ranks and must be the same on each; pass per-rank values "
                "(an optimizer shard, ZeRO/FSDP state) as rank_state"
            )
        rep, own = job.prepared  # type: ignore[misc]
        layout = dtensor.assign([x.chunks for x in proposals])
        reused: list[Reused] = []
        if self.incremental is not None:
            unchanged = {u for x in proposals for u in x.unchanged}
            extents, reused = self.incremental.plan(rep.sizes, unchanged, len(self.slots), first.save_id)
            layout, chunks = self.incremental.plan_chunks(layout, [set(x.unchanged_chunks) for x in proposals],
                                                          first.save_id)
            reused += chunks
        else:
            extents = redundant_plan(rep.sizes, self.slot_nodes, self.redundancy)
        return SavePlan(job.step, catalog.step_dir(job.step), first.save_id, self.slots, extents, layout, rep, own,
                        self.nodes is not None, [x.own for x in proposals], reused)

    def _check_roots_are_local(self, step: int) -> None:
        """First save on several nodes: every node's leader leaves a token in its first root and
        looks for the others' there. Seeing one means two nodes share their roots (a shared
        filesystem): refused on every rank before anything is locked or written."""
        root = self.writer.roots[0]

        def claim() -> str | None:
            if not self.leader:
                return None
            token = f"{catalog.TEMP_SUFFIX}-node-{secrets.token_hex(6)}"
            self.writer.backend.makedirs(root)
            self.writer.backend.write_small(os.path.join(root, token), b"", 0)
            return token

        tokens = agree(self.comm, f"preparing checkpoint step {step} (checking the nodes' roots)", claim)
        mine = tokens[self.rank]

        def check() -> None:
            if mine is None or self.nodes is None:
                return
            try:
                seen = [r for r, t in enumerate(tokens) if t is not None and t != mine
                        and os.path.lexists(os.path.join(root, t))]
            finally:
                self.writer.backend.unlink(os.path.join(root, mine))
            if seen:
                other = self.nodes.ids[self.nodes.of_rank[seen[0]]]
                raise CheckpointWriteError(
                    f"{root} is the first root of node {self.nodes.ids[self.nodes.of_rank[self.rank]]!r} and of node "
                    f"{other!r} (a filesystem shared by the nodes): a job on several nodes writes to node-local roots. "
                    "For roots on a shared filesystem, give every rank the same node id (FASTPERSIST_NODE=shared, "
                    "or node='shared')")

        agree(self.comm, f"preparing checkpoint step {step} (checking the nodes' roots)", check)

    def _adopt(self, proposals: list[Proposal]) -> None:
        """First save on several nodes: every leader learns what every node holds committed
        (a step committed on one node may have its copies on another) before it cleans its
        roots; rank 0 orders the job's commits after all of them."""
        everywhere: dict[int, timeline.Commit] = {}
        for x in proposals:
            for step, c in (x.commits or {}).items():
                if step not in everywhere or c.sequence > everywhere[step].sequence:
                    everywhere[step] = c
        nodes = self.nodes
        known = nodes is None or all(x.commits is not None for r, x in enumerate(proposals) if nodes.is_leader(r))
        if not known:
            logger.warning("a node's roots could not be listed: no node cleans its roots at this start")
        if self.leader:
            self.coordinator.adopt(everywhere, self.rank == 0, known)
        self._inventoried = True

    def _account(self, job: SaveJob, written: list[RankReport]) -> None:
        m = job.metrics
        for r in written[self.rank].reports:
            if r.linked:
                m.bytes_reused += sum(e.nbytes for e in r.extents)
                continue
            m.bytes_per_root[r.root] = m.bytes_per_root.get(r.root, 0) + sum(e.nbytes for e in r.extents)
        m.bytes_written = sum(m.bytes_per_root.values())
        m.bytes_total = sum(e.nbytes for w in written for r in w.reports for e in r.extents)
