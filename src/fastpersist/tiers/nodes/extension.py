"""A job on several nodes, as an extension of the save: node-local roots and copies on other
nodes.

* **First save**: every node's leader leaves a token in its first root and looks for the
  others' (two nodes sharing their roots are refused on every rank before anything is written);
  the leaders' proposals carry what their roots hold committed, and every leader cleans its
  roots only of what *no* node committed (a step committed elsewhere may have its copies here).
* **Every save**: each rank's proposal carries the shape of its unique bytes (its rank_state);
  with ``redundancy`` of 2 or more, beside its own writes each rank sends its unique bytes to
  its partners on the next nodes and writes its senders' copies (:mod:`.copies`).

The commit on every node (each leader writes the same manifest on its node) is the save core's
(:mod:`fastpersist.saving.coordinator`): the roots being node-local is what it commits to.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastpersist import timeline
from fastpersist.dist import agree
from fastpersist.errors import CheckpointWriteError
from fastpersist.saving.extension import Beside, Extension, Writer, Written, parts_of, run_beside
from fastpersist.saving.messages import Proposal, SavePlan
from fastpersist.storage import catalog
from fastpersist.storage.backend import FileBackend
from fastpersist.tiers.nodes.copies import Receiver, Sender, Unique, exchange, partners, senders, unique_extents
from fastpersist.topology import NodeMap

if TYPE_CHECKING:
    from fastpersist.saving.job import SaveJob

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodePart:
    """A rank's part of a proposal on several nodes."""

    own: tuple[int, list[int]] | None  # its rank_state's skeleton length and storage sizes
    commits: dict[int, timeline.Commit] | None = None  # a leader at the first save: its roots' commits
    leader: bool = False
    known: bool = field(default=True)  # a leader could list its roots


class NodeCopies(Extension):
    """Node-local roots and copies of unique bytes on other nodes (see the module)."""

    name = "nodes"
    option = "nodes"

    def __init__(self, nodes: NodeMap, rank: int, roots: Sequence[str], backend: FileBackend, redundancy: int,
                 send: Callable[[list[Any], list[Any]], None] | None) -> None:
        self.nodes, self.rank, self.roots, self.backend = nodes, rank, list(roots), backend
        self.redundancy = redundancy
        self._send = send if redundancy > 1 else None
        self._partners = partners(nodes, rank, redundancy) if self._send is not None else []
        self._senders = senders(nodes, rank, redundancy) if self._send is not None else []
        self._inventoried = False  # the leaders' commits were gathered (first save)

    @property
    def leader(self) -> bool:
        return self.nodes.is_leader(self.rank)

    def start(self, job: SaveJob) -> None:
        """First save: refuse roots shared by nodes, on every rank, before anything is locked."""
        if self._inventoried:
            return
        tokens = agree(self.core.comm, f"preparing checkpoint step {job.step} (checking the nodes' roots)",
                       self._claim)
        agree(self.core.comm, f"preparing checkpoint step {job.step} (checking the nodes' roots)",
              functools.partial(self._check, tokens))

    def _claim(self) -> str | None:
        if not self.leader:
            return None
        token = f"{catalog.TEMP_SUFFIX}-node-{secrets.token_hex(6)}"
        self.backend.makedirs(self.roots[0])
        self.backend.write_small(os.path.join(self.roots[0], token), b"", 0)
        return token

    def _check(self, tokens: list[str | None]) -> None:
        mine = tokens[self.rank]
        if mine is None:
            return
        root = self.roots[0]
        try:
            seen = [r for r, t in enumerate(tokens) if t is not None and t != mine
                    and self.backend.exists(os.path.join(root, t))]
        finally:
            self.backend.unlink(os.path.join(root, mine))
        if seen:
            other = self.nodes.ids[self.nodes.of_rank[seen[0]]]
            raise CheckpointWriteError(
                f"{root} is the first root of node {self.nodes.ids[self.nodes.of_rank[self.rank]]!r} and of node "
                f"{other!r} (a filesystem shared by the nodes): a job on several nodes writes to node-local roots. "
                "For roots on a shared filesystem, give every rank the same node id (FASTPERSIST_NODE=shared, "
                "or node='shared')")

    def propose(self, job: SaveJob) -> NodePart:
        own = job.prepared[1] if job.prepared is not None else None
        unique = (len(own.skeleton), own.sizes) if own is not None else None
        if self._inventoried or not self.leader:
            return NodePart(unique, leader=self.leader)
        commits = self.core.coordinator.local_commits()  # the coordinator started: its roots are locked
        return NodePart(unique, commits, True, commits is not None)

    def prepare(self, job: SaveJob, proposals: Sequence[Proposal]) -> None:
        """First save: every leader learns what every node holds committed before it cleans its
        roots; rank 0 orders the job's commits after all of them."""
        if self._inventoried:
            return
        parts: list[NodePart] = parts_of(proposals, self.name)
        agree(self.core.comm, f"preparing checkpoint step {job.step} (cleaning every node's roots)",
              functools.partial(self._adopt, parts))
        self._inventoried = True  # every rank alike: the collective succeeded everywhere

    def _adopt(self, parts: list[NodePart]) -> None:
        everywhere: dict[int, timeline.Commit] = {}
        for x in parts:
            for step, c in (x.commits or {}).items():
                if step not in everywhere or c.sequence > everywhere[step].sequence:
                    everywhere[step] = c
        known = all(x.known for x in parts if x.leader)
        if not known:
            logger.warning("a node's roots could not be listed: no node cleans its roots at this start")
        if self.leader:
            self.core.coordinator.adopt(everywhere, self.rank == 0, known)

    def plan(self, job: SaveJob, proposals: Sequence[Proposal], plan: SavePlan) -> SavePlan:
        owns = [p.own if p is not None else None for p in parts_of(proposals, self.name)]
        return _with_part(plan, self.name, owns)

    def beside_write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Beside | None:
        """With copies on other nodes: send this rank's unique bytes to its partners and write
        the copies of its senders' (see :mod:`.copies`)."""
        send = self._send
        if send is None:
            return None
        owns: list[tuple[int, list[int]] | None] = plan.parts[self.name]
        roots = len(self.roots)

        def extents(rank: int) -> list[Unique]:
            return unique_extents(owns[rank], [x for x in plan.layout.pieces if x.rank == rank], roots)

        mine = extents(self.rank)
        sender = Sender(mine, plan.own, job.shards, plan.layout) if mine else None
        node = self.nodes.of_rank[self.rank]
        dirs = [os.path.join(root, plan.directory) for root in self.roots]
        receivers = [Receiver(k, ext, plan.save_id, node, dirs, self.backend) for k in self._senders
                     if (ext := extents(k))]
        to = self._partners
        return run_beside("copies", lambda: Written(tuple(exchange(send, sender, to, receivers))))


def _with_part(plan: SavePlan, name: str, part: object) -> SavePlan:
    return dataclasses.replace(plan, parts={**plan.parts, name: part})
