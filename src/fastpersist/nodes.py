"""Nodes: which ranks share a machine (and its local disks), and how copies are placed on them.

A job's checkpoint roots are node-local: each node has its own disks, and a rank opens only its
own node's roots. A node is named by ``Checkpointer(node=...)``, else the environment variable
``FASTPERSIST_NODE``, else the host name. With ``redundancy=r`` (r <= nodes), every byte of the
replicated state is written on r distinct nodes: the stream of its storages is cut into one
segment per node, and copy c of segment j goes to node (j + c) mod N, cut over that node's
writer slots the same way on every copy (so the copies of an extent are the same bytes with the
same checksum). No byte crosses the network (every node holds the replicated state), and each
node writes r/N of it, over all its writers and roots at once.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from fastpersist.format.manifest import valid_node_id
from fastpersist.plan import ALIGN, Extent, plan

ENV_NODE = "FASTPERSIST_NODE"


def node_id(node: str | None, host: str) -> str:
    """This process's node id: ``node`` if given, else ``$FASTPERSIST_NODE``, else ``host``."""
    if node is not None and not isinstance(node, str):
        raise TypeError(f"node must be a string (a node id), got {type(node).__name__}")
    chosen = node if node is not None else os.environ.get(ENV_NODE) or host
    if not valid_node_id(chosen):
        source = "node" if node is not None else (ENV_NODE if os.environ.get(ENV_NODE) else "the host name")
        raise ValueError(f"{source}: a node id is 1 to 200 printable characters, got {chosen!r}")
    return chosen


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: ``ids[n]`` is node n's id, ``of_rank[r]`` rank r's node (nodes are
    numbered in the order of their lowest rank)."""

    ids: tuple[str, ...]
    of_rank: tuple[int, ...]

    @classmethod
    def from_ids(cls, per_rank: Sequence[str]) -> Nodes:
        order: dict[str, int] = {}
        for n in per_rank:
            order.setdefault(n, len(order))
        return cls(tuple(order), tuple(order[n] for n in per_rank))

    @property
    def count(self) -> int:
        return len(self.ids)

    def per_rank(self) -> list[str]:
        """Every rank's node id (``writers`` policies count per node; on one node, per host)."""
        return [self.ids[n] for n in self.of_rank]

    def ranks(self, node: int) -> list[int]:
        return [r for r, n in enumerate(self.of_rank) if n == node]

    def leader(self, node: int) -> int:
        """The rank that speaks for ``node``'s disks (its manifest, lock and clean-up)."""
        return self.of_rank.index(node)

    def is_leader(self, rank: int) -> bool:
        return self.leader(self.of_rank[rank]) == rank


def default_redundancy(nodes: int) -> int:
    return 2 if nodes > 1 else 1


def check_redundancy(redundancy: int | None, nodes: Nodes, writers: Sequence[int] | None = None) -> int:
    """The number of copies to write: ``redundancy`` (default 2 on several nodes, 1 on one),
    refused when the nodes (those of the replicated state's ``writers``, if given) cannot hold
    that many distinct copies."""
    chosen = default_redundancy(nodes.count) if redundancy is None else _valid(redundancy, nodes)
    if writers is not None:
        on = len({nodes.of_rank[r] for r in writers})
        if on < chosen:
            raise ValueError(f"redundancy={chosen} needs writers on {chosen} nodes; the writers {sorted(writers)} are "
                             f"on {on}")
    return chosen


def _valid(redundancy: int, nodes: Nodes) -> int:
    if isinstance(redundancy, bool) or not isinstance(redundancy, int):
        raise TypeError(f"redundancy must be an integer, got {type(redundancy).__name__}")
    if redundancy < 1:
        raise ValueError(f"redundancy must be at least 1, got {redundancy}")
    if redundancy > nodes.count:
        raise ValueError(f"redundancy={redundancy} needs {redundancy} nodes, but the job runs on {nodes.count} "
                         f"({', '.join(nodes.ids)}): every copy of a byte lies on a node of its own")
    return redundancy


def redundant_plan(sizes: Sequence[int], slot_nodes: Sequence[int], copies: int,
                   align: int = ALIGN) -> list[Extent]:
    """The replicated bytes over the writer slots, each byte range on ``copies`` distinct nodes.

    ``slot_nodes[s]`` is slot s's node. With one copy this is :func:`fastpersist.plan.plan`.
    Otherwise the stream is cut into N segments (one per node with writer slots) of q pieces
    each, q the fewest slots any node has; piece i of segment j goes, for each copy c, to slot i
    of node (j + c) mod N. The result holds ``copies`` extents for each byte range (same
    storage, start and length), in stream order and then copy order.
    """
    if copies <= 1:
        return plan(sizes, len(slot_nodes), align)
    nodes = sorted(set(slot_nodes))
    if copies > len(nodes):
        raise ValueError(f"{copies} copies need {copies} nodes with writers, got {len(nodes)}")
    by_node = [[s for s, n in enumerate(slot_nodes) if n == node] for node in nodes]
    q = min(len(slots) for slots in by_node)
    count = len(nodes)
    out = []
    for e in plan(sizes, count * q, align):
        segment, piece = divmod(e.slot, q)
        for c in range(copies):
            out.append(Extent(e.storage, e.start, e.nbytes, by_node[(segment + c) % count][piece]))
    return out
