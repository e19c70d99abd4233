"""The save core of one rank, wired as a Checkpointer wires it, without the Checkpointer: for
unit tests of the protocol, its parts and its extensions."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import fastpersist as fp
from fastpersist.dist import Comm
from fastpersist.options import Retention
from fastpersist.saving.coordinator import Coordinator
from fastpersist.saving.extension import Extension
from fastpersist.saving.handle import Completion, SaveHandle, SaveMetrics
from fastpersist.saving.job import SaveJob, new_job
from fastpersist.saving.protocol import SaveProtocol
from fastpersist.saving.rank_writer import RankWriter
from fastpersist.storage.backend import FileBackend
from fastpersist.topology import NodeMap, Placement


def make_protocol(comm: Comm, roots: Sequence[str], extensions: Sequence[Extension] = (),
                  keep: int | None = None, node_ids: Sequence[str] | None = None,
                  backend: FileBackend | None = None, redundancy: int = 1) -> SaveProtocol:
    """One rank's save core over ``roots`` (``node_ids``: every rank's node, default one node)."""
    backend = backend or FileBackend()
    nodes = NodeMap.from_ids(list(node_ids) if node_ids is not None else ["one"] * comm.world_size)
    coordinator = Coordinator(roots, backend, Retention(keep), comm.world_size, True, nodes, comm.rank)
    leads = nodes.count > 1 and nodes.is_leader(comm.rank)
    writer = RankWriter(comm.rank, roots, backend, fp.get_config, nodes.of_rank[comm.rank] if leads else None)
    placement = Placement.of(list(range(comm.world_size)), len(roots), nodes, redundancy)
    return SaveProtocol(comm, writer, coordinator, placement, nodes=nodes, extensions=extensions)


def job(step: int, state: Any, number: int = 1, *, rank_state: Any = None, directory: str | None = None) -> SaveJob:
    """A sync save's job of ``state`` (``number``: the save's number, the same on every rank)."""
    j = new_job(step, state, rank_state, None, Completion(SaveHandle(SaveMetrics(step, "sync"))),
                time.perf_counter())
    j.number, j.directory = number, directory
    return j
