"""The save protocol's messages: what the ranks tell each other about one checkpoint.

Every message is a frozen dataclass: built once by the rank that sends it, read by every rank
that receives it (they travel through :func:`fastpersist.dist.agree`'s all-gather), never
changed on the way. The protocol (:mod:`fastpersist.saving.protocol`) knows their core fields;
what an extension (:mod:`fastpersist.saving.extension`) adds to a message travels in its
``parts`` under the extension's name, so the protocol carries parts it does not know.

In protocol order:

1. :class:`Proposal` (every rank): what this rank is about to save;
2. :class:`SavePlan` (derived alike on every rank from the proposals, never sent);
3. :class:`RankReport` (every rank): what this rank wrote;
4. :class:`Committed` (rank 0): the commit's outcome, with its :class:`Decision` on several nodes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastpersist.format import manifest as mf
from fastpersist.objects import dtensor
from fastpersist.objects.write import FileReport, Prepared
from fastpersist.plan import Extent

ChunkKey = tuple[tuple[str | int, ...], tuple[int, ...], tuple[int, ...]]  # a DTensor chunk: (path, offsets, sizes)
Objects = Mapping[str, tuple[list[str], list[int], list[mf.TensorEntry]]]  # object -> (keys, sizes, tensors)


def chunk_key(meta: dtensor.ChunkMeta) -> ChunkKey:
    """The key a DTensor chunk is known by in every message (its path and box)."""
    return (meta.path, meta.offsets, meta.sizes)


@dataclass(frozen=True)
class Proposal:
    """The propose phase (every rank): what this rank is about to save."""

    digest: str  # of the plan: storages' sizes, slots and the skeleton
    save_id: str  # rank 0's is used by everyone
    step: int
    number: int  # this Checkpointer's n-th save on that rank (ranks out of step are caught)
    chunks: tuple[dtensor.ChunkMeta, ...]  # this rank's DTensor chunks
    parts: Mapping[str, Any] = field(default_factory=dict)  # extension name -> its part
    extensions: tuple[str, ...] = ()  # the options of the extensions this rank runs (the ranks must agree)


@dataclass(frozen=True)
class SavePlan:
    """What every rank agreed to write for one checkpoint (derived alike on every rank)."""

    step: int
    directory: str  # the checkpoint's directory name in every root
    save_id: str
    slots: tuple[tuple[int, int], ...]  # (writer rank, root) of each replicated-state slot
    extents: tuple[Extent, ...]  # the replicated bytes over the slots
    layout: dtensor.Layout  # who writes which DTensor chunk
    replicated: Prepared
    own: Prepared | None  # this rank's rank_state
    multi_node: bool = False  # several nodes: each node's leader writes its copy of the skeleton
    parts: Mapping[str, Any] = field(default_factory=dict)  # extension name -> what it planned


@dataclass(frozen=True)
class RankReport:
    """The write phase (every rank): what this rank wrote, for the manifest."""

    reports: tuple[FileReport, ...]
    objects: Objects  # the objects whose skeleton this rank wrote
    parts: Mapping[str, Any] = field(default_factory=dict)  # extension name -> its part


@dataclass(frozen=True)
class Decision:
    """Rank 0's part of a commit on several nodes, for every node's leader."""

    sequence: int
    created: float
    live: frozenset[int]  # the committed steps retention keeps (a leader deletes the others of its node)
    metadata: Mapping[str, Any] | None = None  # rank 0's, as on one node


@dataclass(frozen=True)
class Committed:
    """The commit phase (rank 0): the commit's outcome. On one node the manifest is written by
    then; on several nodes ``decision`` is what every node's leader writes next."""

    decision: Decision | None = None
    parts: Mapping[str, Any] = field(default_factory=dict)  # extension name -> what it decided at the commit
