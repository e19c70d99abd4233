"""What a save does besides writing and committing its bytes: extensions of the save protocol.

Incremental reuse, the replica check, copies on other nodes, the durable drain and publishing
into a named directory each vary the save at a few points and nowhere else. Each is an
:class:`Extension`: the protocol (:mod:`fastpersist.saving.protocol`) calls its hooks at those
points, on every rank, in the order the extensions were registered, and carries what a hook
returns in the messages (:mod:`fastpersist.saving.messages`) under the extension's ``name``.
Every hook has a default that does nothing, so an extension writes only the hooks it needs.

The hooks, in the order a save reaches them (``(collective)``: every rank calls it alike and
it may run collectives of its own; the others must not)::

    attach(core)                           once, when the protocol is built
    start(job)                (collective) before the proposal (a first save on several nodes)
    propose(job) -> part                   this rank's part of its Proposal (None: none)
    plan(job, proposals, plan) -> plan     on every rank alike: refuse (raise) or adjust the plan
    prepare(job, proposals)   (collective) the plan is agreed; nothing is written yet
    beside_write(job, plan, writer)        started before this rank's writes, runs beside them
    write(job, plan, writer)               after this rank's own writes: more files of its own
    check(job, plan, written)              on every rank alike: every report is known; before the commit
    decide(job, plan) -> part              rank 0, inside the commit step, before the commit point
    committed(job, plan, written, outcome) (collective) after the commit, before retention
    failed(job, plan, outcome)             the write or the commit failed, before the files are removed
    protected() -> steps                   steps retention must spare now
    elsewhere() -> commits                 commits held outside the roots (new ones are numbered after)
    close()                                the Checkpointer closes

``plan`` and ``check`` run on each rank without a collective: they must decide alike on every
rank, from what every rank sees (the messages), or the ranks would part ways; so must ``start``
and ``prepare`` (a refusal there goes through a collective of their own). A ``propose``,
``write``, ``beside_write`` or ``decide`` hook that raises fails the save on every rank (the
phase's all-gather carries the error). An extension's part of the rank's report comes from
``beside_write`` or from ``write``, not both. The ranks must run the same extensions (each
proposal names them; a difference is refused, naming the extension's ``option``). After the
commit the checkpoint stays committed whatever a hook raises: every ``committed`` hook runs,
then retention, and the first error is raised then (it fails the save's handle: publishing does
when the named directory could not take the checkpoint). A ``failed`` hook that raises is
logged; the cleanup and the save's own error go on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from fastpersist import timeline
from fastpersist.objects import dtensor
from fastpersist.objects.write import FileReport
from fastpersist.plan import Extent
from fastpersist.saving.messages import Committed, Proposal, RankReport, SavePlan

if TYPE_CHECKING:
    from fastpersist.dist import Comm
    from fastpersist.saving.coordinator import Coordinator
    from fastpersist.saving.job import SaveJob


class Core(Protocol):
    """What the save core lends its extensions (the save protocol is one)."""

    comm: Comm
    coordinator: Coordinator

    def retain(self) -> None:
        """Apply retention now (rank 0; the other nodes' leaders follow it at each commit)."""


class Writer(Protocol):
    """What a rank's writer lends an extension's ``write`` (the rank writer is one)."""

    rank: int
    roots: list[str]

    def write_replicated(self, plan: SavePlan, extents: Sequence[Extent], root: int, path: str) -> FileReport:
        """Write ``extents`` of the replicated state into a new file ``path`` on ``root``."""

    def write_chunk_extents(self, plan: SavePlan, shards: Sequence[dtensor.LocalShard], extents: Sequence[Any],
                            root: int, path: str) -> FileReport:
        """Write extents of DTensor chunks (``storage``: a chunk's index in the plan's layout)
        this rank holds into a new file ``path`` on ``root``."""


@dataclass(frozen=True)
class Written:
    """What an extension wrote on this rank: files of the checkpoint, and its part of the
    rank's report."""

    files: tuple[FileReport, ...] = ()
    part: Any = None


@dataclass
class Beside:
    """Work an extension runs beside this rank's writes: ``future`` gives what it wrote."""

    future: Future[Written] = field(default_factory=Future)

    def result(self) -> Written:
        return self.future.result()

    def abandon(self) -> None:
        """The rank's own writes failed: wait for the work to end (it must not outlive the
        save), its own failure being secondary."""
        self.future.exception()


def run_beside(name: str, fn: Callable[[], Written]) -> Beside:
    """``fn()`` in a thread of its own (named for the extension), as a :class:`Beside`."""
    import threading

    beside = Beside()

    def run() -> None:
        if not beside.future.set_running_or_notify_cancel():  # pragma: no cover - never cancelled
            return
        try:
            beside.future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to result()
            beside.future.set_exception(e)

    threading.Thread(target=run, name=f"fastpersist-{name}", daemon=True).start()
    return beside


class Extension:
    """One thing a save does besides its core (see the module for the hooks and their order)."""

    name: ClassVar[str] = "extension"  # its key in the messages' parts
    option: ClassVar[str] = ""  # the Checkpointer argument that turns it on (named when ranks differ); "": its name
    core: Core

    def attach(self, core: Core) -> None:
        self.core = core

    def start(self, job: SaveJob) -> None:
        pass

    def propose(self, job: SaveJob) -> Any:
        return None

    def plan(self, job: SaveJob, proposals: Sequence[Proposal], plan: SavePlan) -> SavePlan:
        return plan

    def prepare(self, job: SaveJob, proposals: Sequence[Proposal]) -> None:
        pass

    def beside_write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Beside | None:
        return None

    def write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Written | None:
        return None

    def check(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport]) -> None:
        pass

    def decide(self, job: SaveJob, plan: SavePlan) -> Any:
        return None

    def committed(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport], outcome: Committed) -> None:
        pass

    def failed(self, job: SaveJob, plan: SavePlan, outcome: Committed | None) -> None:
        pass

    def protected(self) -> set[int]:
        return set()

    def elsewhere(self) -> list[timeline.Commit]:
        return []

    def close(self) -> None:
        pass


def parts_of(messages: Sequence[Proposal] | Sequence[RankReport], name: str) -> list[Any]:
    """Every rank's part of ``name`` in ``messages`` (None where a rank gave none)."""
    return [m.parts.get(name) for m in messages]
