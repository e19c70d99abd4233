"""The save protocol: the phases every rank runs for one checkpoint.

Each phase that needs the other ranks is one :func:`fastpersist.dist.agree` of a named message
(:mod:`fastpersist.saving.messages`): a failure anywhere raises everywhere, and nobody waits in
a collective the others skipped.

1. **propose** (all ranks): serialize the state (unless staging did), send a
   :class:`~fastpersist.saving.messages.Proposal`: the plan's digest (storages' sizes, slots,
   skeleton), a save id (rank 0's is used), the step and this save's number (ranks out of step
   are caught), this rank's DTensor chunks. The rank that speaks for its node's roots takes
   their lock first and, at the first save, cleans up after a crashed run.
2. **plan** (all ranks, no message): every rank derives the same
   :class:`~fastpersist.saving.messages.SavePlan` from the proposals, or refuses alike.
3. **write** (all ranks, :class:`~fastpersist.saving.rank_writer.RankWriter`): every file
   fsync'd, then the directories; each rank sends a
   :class:`~fastpersist.saving.messages.RankReport` of what it wrote.
4. **commit** (rank 0, :class:`~fastpersist.saving.coordinator.Coordinator`): the manifest
   built from every report is written last, atomically and durably; then ``latest``; every
   rank hears the :class:`~fastpersist.saving.messages.Committed` outcome. On several nodes
   (node-local roots) rank 0 decides the commit (its sequence, what retention keeps) and then
   every node's leader writes the same manifest on its node.
5. **after-commit** (all ranks): the commit replaces an earlier save of the same step; the
   extensions take note; retention runs (deleting in the background).

What varies (incremental reuse, the replica check, copies on other nodes, the durable drain,
publishing into a named directory) is an :class:`~fastpersist.saving.extension.Extension`,
whose hooks the phases call in order; the protocol knows none of them.

If a phase fails anywhere before the commit point, no manifest exists, ``latest`` is unchanged
and each rank removes the files it wrote for this save id. Nothing after the commit fails the
save.
"""

from __future__ import annotations

import functools
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from fastpersist.dist import Comm, agree
from fastpersist.errors import CheckpointError, CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.format.template import Templates
from fastpersist.objects import dtensor
from fastpersist.objects.write import prepare
from fastpersist.saving.coordinator import Coordinator
from fastpersist.saving.extension import Extension
from fastpersist.saving.job import SaveJob
from fastpersist.saving.messages import Committed, Decision, Proposal, RankReport, SavePlan
from fastpersist.saving.rank_writer import RankWriter
from fastpersist.storage import catalog
from fastpersist.topology import NodeMap, Placement

logger = logging.getLogger(__name__)


@dataclass
class _Attempt:
    """One job's way through the phases: what each phase produced so far."""

    job: SaveJob
    plan: SavePlan
    written: list[RankReport] = field(default_factory=list)
    outcome: Committed | None = None


class SaveProtocol:
    """Runs the protocol for one job at a time, on every rank (in the save driver's worker).

    Args:
        comm: the ranks (the Checkpointer's own groups, never the training's).
        writer, coordinator: this rank's writer (phase 3) and its node's roots (phase 4).
        placement: the replicated state's writer slots and copies (every rank alike).
        nodes: the job's nodes (several: node-local roots, a commit on every node).
        extensions: what varies, called in this order at every phase.
        in_flight: the steps of the saves queued or running (retention spares them).
    """

    def __init__(self, comm: Comm, writer: RankWriter, coordinator: Coordinator, placement: Placement, *,
                 nodes: NodeMap | None = None, extensions: Sequence[Extension] = (),
                 in_flight: Callable[[], set[int]] = set) -> None:
        self.comm = comm
        self.writer = writer
        self.coordinator = coordinator
        self.placement = placement
        self.nodes = nodes if nodes is not None and nodes.count > 1 else None
        self.extensions = list(extensions)
        self._in_flight = in_flight
        self.templates = Templates()  # skeletons of structures saved before, written without pickling
        self.broken: str | None = None  # set on every rank alike when the ranks fell out of step
        for ext in self.extensions:
            ext.attach(self)

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def leader(self) -> bool:
        """Whether this rank speaks for its node's roots (on one node: rank 0)."""
        return self.nodes.is_leader(self.rank) if self.nodes is not None else self.rank == 0

    def in_flight(self) -> set[int]:
        return self._in_flight()

    def protected(self) -> set[int]:
        """The steps retention spares now: those in flight, and those an extension holds."""
        return self.in_flight().union(*(ext.protected() for ext in self.extensions))

    def retain(self) -> None:
        """Apply retention now (an extension that held steps back let them go). Rank 0 only:
        on several nodes the other leaders follow rank 0's decisions at each commit."""
        if self.rank == 0:
            self.coordinator.retain(self.protected())

    def settle(self) -> None:
        """Wait for the deletions retention started."""
        self.coordinator.janitor.drain()

    def close(self) -> None:
        """Finish the extensions' background work (the drains in flight), then release the
        roots (every closer runs, the first failure is raised)."""
        close_all(*(ext.close for ext in self.extensions), self.coordinator.close)

    def run(self, job: SaveJob) -> None:
        """One checkpoint, on every rank: propose → plan → write → commit → after-commit."""
        if self.broken is not None:  # no collective: the other ranks stopped too
            job.completion.staged()
            raise CheckpointWriteError(self.broken)
        try:
            attempt = _Attempt(job, self._agree_on_plan(job))
        except BaseException:
            job.completion.staged()
            raise
        try:
            self._write(attempt)
            outcome = self._commit(attempt)
        except CheckpointError:
            self._failed(attempt)
            raise
        self._after_commit(attempt, outcome)

    # ------------------------------------------------------------------------------------
    # propose and plan

    def _agree_on_plan(self, job: SaveJob) -> SavePlan:
        for ext in self.extensions:
            ext.start(job)
        proposals = agree(self.comm, f"preparing checkpoint step {job.step}", functools.partial(self._propose, job))
        plan = self._plan(job, proposals)
        for ext in self.extensions:
            plan = ext.plan(job, proposals, plan)
        for ext in self.extensions:
            ext.prepare(job, proposals)
        return plan

    def _propose(self, job: SaveJob) -> Proposal:
        """This rank's proposal: its state serialized (unless staging did), its lock taken."""
        if job.prepared is None:
            rep = prepare(mf.REPLICATED, job.state, self.templates)
            own = (prepare(mf.rank_object(self.rank), job.rank_state, self.templates)
                   if job.rank_state is not None else None)
            job.prepared = (rep, own)
        job.metrics.templated = job.prepared[0].templated
        if self.leader:
            self.coordinator.start(job.step)
        rep = job.prepared[0]
        parts = {ext.name: part for ext in self.extensions if (part := ext.propose(job)) is not None}
        return Proposal(self.placement.digest(rep.sizes, rep.skeleton_checksum), secrets.token_hex(6), job.step,
                        job.number, tuple(sh.meta for sh in job.shards), parts,
                        tuple(ext.option or ext.name for ext in self.extensions))

    def _plan(self, job: SaveJob, proposals: Sequence[Proposal]) -> SavePlan:
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
        mixed = [r for r, x in enumerate(proposals) if set(x.extensions) != set(first.extensions)]
        if mixed:  # every rank must run every extension's hooks, or some would wait in a collective
            theirs = proposals[mixed[0]].extensions
            name = sorted(set(theirs) ^ set(first.extensions))[0]
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: the ranks' Checkpointers disagree on {name}=: rank {mixed[0]} "
                f"{'uses' if name in theirs else 'does not use'} it, rank 0 "
                f"{'does' if name in first.extensions else 'does not'}; every rank constructs its Checkpointer with "
                "the same arguments")
        differing = [r for r, x in enumerate(proposals) if x.digest != first.digest]
        if differing:
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: the replicated state differs between ranks: ranks {differing} disagree "
                "with rank 0 on its structure (the keys, the tensors' sizes and dtypes, or the pickled values). "
                "`state` is written once for all ranks and must be the same on each; pass per-rank values "
                "(an optimizer shard, ZeRO/FSDP state) as rank_state"
            )
        rep, own = job.prepared  # type: ignore[misc]
        return SavePlan(job.step, catalog.step_dir(job.step), first.save_id, self.placement.slots,
                        tuple(self.placement.extents(rep.sizes)), dtensor.assign([x.chunks for x in proposals]),
                        rep, own, self.nodes is not None)

    # ------------------------------------------------------------------------------------
    # write and commit

    def _write(self, a: _Attempt) -> None:
        write = functools.partial(self.writer.write, a.job, a.plan, self.extensions)
        a.written = agree(self.comm, f"writing checkpoint step {a.job.step}", write)
        for ext in self.extensions:
            ext.check(a.job, a.plan, a.written)

    def _commit(self, a: _Attempt) -> Committed:
        decide = functools.partial(self._decide, a.job, a.plan, a.written)
        outcome = agree(self.comm, f"committing checkpoint step {a.job.step}", decide)[0]
        if outcome is None:  # pragma: no cover - rank 0 always sends one
            raise CheckpointWriteError(f"committing checkpoint step {a.job.step}: rank 0 sent no outcome")
        a.outcome = outcome  # a failure on the nodes from here on must know what rank 0 decided
        decision = outcome.decision
        if decision is not None:
            on_node = functools.partial(self._commit_on_node, a.job.step, a.plan, a.written, decision)
            agree(self.comm, f"committing checkpoint step {a.job.step} on every node", on_node)
        return outcome

    def _decide(self, job: SaveJob, plan: SavePlan, written: list[RankReport]) -> Committed | None:
        """Rank 0's part of the commit step (the others send None): the extensions' decisions
        first (a step to drain is marked before any rank can learn of its commit), then the
        commit itself, or, on several nodes, the decision every node's leader commits next."""
        if self.rank != 0:
            return None
        parts = {ext.name: part for ext in self.extensions if (part := ext.decide(job, plan)) is not None}
        elsewhere = [c for ext in self.extensions for c in ext.elsewhere()]
        if self.nodes is not None:
            return Committed(self.coordinator.decide(job.step, job.metadata, self.protected(), elsewhere), parts)
        self.coordinator.commit(job.step, plan.save_id, written, job.metadata, plan.layout, elsewhere)
        return Committed(None, parts)

    def _commit_on_node(self, step: int, plan: SavePlan, written: list[RankReport], decision: Decision) -> None:
        if self.leader:
            self.coordinator.commit_node(step, plan.save_id, written, plan.layout, decision)

    def _failed(self, a: _Attempt) -> None:
        """Before the commit point: every rank removes what it wrote for this save id. When the
        nodes' commit failed on some after others wrote, the files stay if any node committed."""
        for ext in self.extensions:
            self._quietly(a.job.step, f"extension {ext.name!r} after the failure", ext.failed, a.job, a.plan,
                          a.outcome, committed=False)
        decision = a.outcome.decision if a.outcome is not None else None
        if not self._committed(a.job.step, a.plan.save_id, decision is not None):
            catalog.remove_files(self.writer.roots, a.job.step, f"{a.plan.save_id}-", self.writer.backend, prune=True)
        elif decision is not None and self.rank == 0:
            self.coordinator.record(a.job.step, decision)

    def _committed(self, step: int, save_id: str, on_nodes: bool) -> bool:
        """After a failure: whether this save is committed (its files must stay). On several
        nodes it is if any node wrote its manifest (every rank hears which; a rank that cannot
        ask keeps its files: a later start removes them if no node committed the step)."""
        here = self.coordinator.is_committed(step, save_id)
        if not on_nodes:
            return here
        try:
            return any(self.comm.all_gather(here))
        except CheckpointError:
            return True

    # ------------------------------------------------------------------------------------
    # after the commit: the checkpoint stays committed whatever happens here

    def _after_commit(self, a: _Attempt, outcome: Committed) -> None:
        """Every extension's ``committed`` hook runs, then retention, whatever a hook raised (so
        every rank reaches the same collectives); the first error a hook raised is raised then."""
        job = a.job
        self._account(job, a.written)
        if self.leader:
            self._quietly(job.step, "removing an earlier save of the same step", self.coordinator.replaced,
                          job.step, a.written)
        error: CheckpointError | None = None
        for ext in self.extensions:
            try:
                ext.committed(job, a.plan, a.written, outcome)
            except Exception as e:  # noqa: BLE001 - raised once every hook and retention have run
                error = error or (e if isinstance(e, CheckpointError) else CheckpointWriteError(
                    f"checkpoint step {job.step} is committed; extension {ext.name!r} failed after the commit: "
                    f"{type(e).__name__}: {e}"))
        if self.leader:
            self._quietly(job.step, "applying retention", self.coordinator.after_commit, job.step,
                          self.protected() | {job.step}, outcome.decision)
        job.metrics.total_s = time.perf_counter() - job.started
        if error is not None:
            raise error

    @staticmethod
    def _quietly(step: int, what: str, fn: Callable[..., object], *args: object, committed: bool = True) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a cleanup failure must not hide or replace the outcome
            state = "is committed" if committed else "failed"
            logger.warning("checkpoint step %d %s; %s failed: %s", step, state, what, e)

    def _account(self, job: SaveJob, written: list[RankReport]) -> None:
        m = job.metrics
        for r in written[self.rank].reports:
            if r.linked:
                m.bytes_reused += sum(e.nbytes for e in r.extents)
                continue
            m.bytes_per_root[r.root] = m.bytes_per_root.get(r.root, 0) + sum(e.nbytes for e in r.extents)
        m.bytes_written = sum(m.bytes_per_root.values())
        m.bytes_total = sum(e.nbytes for w in written for r in w.reports for e in r.extents)



def close_all(*closers: Callable[[], object] | None) -> None:
    """Call each closer in order, every one even if an earlier one raised (the first error is
    raised at the end)."""
    if not closers:
        return
    first, rest = closers[0], closers[1:]
    try:
        if first is not None:
            first()
    finally:
        close_all(*rest)
