"""Where a job's ranks are and who writes what: nodes, writers, copies. Pure.

* :class:`NodeMap`: which ranks share a machine (and its local disks);
* :func:`writer_ranks`: the ranks that write the replicated state (the ``writers`` policy);
* :class:`Placement`: the replicated state's writer slots and its copies over the nodes.

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
from fastpersist.plan import ALIGN, Extent, plan, plan_digest

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
class NodeMap:
    """The job's nodes: ``ids[n]`` is node n's id, ``of_rank[r]`` rank r's node (nodes are
    numbered in the order of their lowest rank)."""

    ids: tuple[str, ...]
    of_rank: tuple[int, ...]

    @classmethod
    def from_ids(cls, per_rank: Sequence[str]) -> NodeMap:
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


def check_redundancy(redundancy: int | None, nodes: NodeMap, writers: Sequence[int] | None = None) -> int:
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


def _valid(redundancy: int, nodes: NodeMap) -> int:
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


def writer_ranks(policy: str | int | Sequence[int], hosts: Sequence[str]) -> list[int]:
    """The ranks that write replicated state, given each rank's host name.

    ``"all"``: every rank; ``"node"``: the first rank of every host; an int ``N``: the first N
    ranks of every host; a list: exactly those ranks.
    """
    world = len(hosts)
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hosts):
        by_host.setdefault(h, []).append(r)
    if policy == "all":
        return list(range(world))
    if policy == "node":
        return sorted(ranks[0] for ranks in by_host.values())
    if isinstance(policy, int) and not isinstance(policy, bool):
        if policy < 1:
            raise ValueError(f"writers={policy}: at least one writer per node is needed")
        return sorted(r for ranks in by_host.values() for r in ranks[:policy])
    if isinstance(policy, str):
        raise ValueError(f"writers={policy!r}: use 'all', 'node', a number per node or a list of ranks")
    if isinstance(policy, bool) or not isinstance(policy, Sequence):
        raise TypeError(f"writers must be 'all', 'node', an int or a list of ranks, got {policy!r}")
    chosen = sorted(set(int(r) for r in policy))
    bad = [r for r in chosen if not 0 <= r < world]
    if not chosen or bad:
        raise ValueError(f"writers={list(policy)}: ranks must be in 0..{world - 1} and not empty")
    return chosen


@dataclass(frozen=True)
class Placement:
    """Where the replicated state goes: its writer slots (writer rank, root), each slot's node,
    and on how many nodes each byte lies. Every rank derives the same from the Checkpointer's
    arguments; a proposal's digest covers it, so ranks that differ fail the save."""

    slots: tuple[tuple[int, int], ...]
    slot_nodes: tuple[int, ...]
    redundancy: int = 1

    @classmethod
    def of(cls, writers: Sequence[int], roots: int, nodes: NodeMap, redundancy: int = 1) -> Placement:
        slots = tuple((r, j) for r in writers for j in range(roots))
        multi = nodes.count > 1
        return cls(slots, tuple(nodes.of_rank[r] if multi else 0 for r, _ in slots), redundancy)

    def extents(self, sizes: Sequence[int]) -> list[Extent]:
        """The replicated bytes over the slots, each on ``redundancy`` nodes."""
        return redundant_plan(sizes, self.slot_nodes, self.redundancy)

    def digest(self, sizes: Sequence[int], skeleton_checksum: int) -> str:
        """What a proposal's digest covers: the storages' sizes, the slots, the skeleton and
        the placement over the nodes."""
        extra = skeleton_checksum.to_bytes(8, "big") + f"|{self.redundancy}|{list(self.slot_nodes)}".encode()
        return plan_digest(sizes, len(self.slots), extra=extra)
