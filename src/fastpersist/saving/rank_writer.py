"""The write phase on one rank: this rank's files of a checkpoint.

Every writer rank writes its slots of the replicated state (one file per root, all at once),
the rank that speaks for its node's roots the skeleton, every rank its own ``rank_state`` and
its pieces of the DTensor chunks; the extensions add theirs (work beside the writes, files after
them: :mod:`fastpersist.saving.extension`). Every file is fsync'd, then the directories. What
the rank wrote goes to the commit in a :class:`~fastpersist.saving.messages.RankReport`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.objects import dtensor
from fastpersist.objects.write import FileReport, write_chunks, write_skeleton, write_slots
from fastpersist.plan import Extent, plan
from fastpersist.saving.extension import Beside, Extension, Written
from fastpersist.saving.job import SaveJob
from fastpersist.saving.messages import Objects, RankReport, SavePlan, chunk_key
from fastpersist.storage.backend import FileBackend


class RankWriter:
    """Writes one rank's part of a checkpoint under ``roots``.

    ``skeleton_node``: on several nodes, this rank's node if it is the node's leader (it writes
    the node's copy of the replicated skeleton), else None; on one node rank 0 writes it.
    """

    def __init__(self, rank: int, roots: Sequence[str], backend: FileBackend, config: Callable[[], IOConfig],
                 skeleton_node: int | None = None) -> None:
        self.rank = rank
        self.roots = list(roots)
        self.backend = backend
        self._config = config
        self.skeleton_node = skeleton_node

    def write(self, job: SaveJob, plan: SavePlan, extensions: Sequence[Extension] = ()) -> RankReport:
        """Write everything this rank owns of ``job``, the extensions' work beside it; the job
        is staged once the live tensors are no longer read (written, or the write failed)."""
        t0 = time.perf_counter()
        try:
            dirs = [os.path.join(root, plan.directory) for root in self.roots]
            # beside every write of this rank's own: the extensions' work (copies for other
            # nodes run all their rounds whatever happens here, so no rank waits for a message)
            besides: list[tuple[str, Beside]] = []
            try:
                for ext in extensions:
                    beside = ext.beside_write(job, plan, self)
                    if beside is not None:
                        besides.append((ext.name, beside))
                reports, objects = self._write_own(job, plan, dirs)
                parts: dict[str, Any] = {}
                for ext in extensions:
                    done = ext.write(job, plan, self)
                    if done is not None:
                        reports += done.files
                        parts[ext.name] = done.part
            except BaseException:
                _abandon(besides)
                raise
            for name, done in _results(besides):
                reports += done.files
                if done.part is not None:
                    if parts.get(name) is not None:
                        raise CheckpointWriteError(f"extension {name!r} gave a part of the report twice "
                                                   "(from beside_write and from write)")
                    parts[name] = done.part
            for d in dirs:  # the new files' directory entries are durable too
                self.backend.fsync_dir(d)
            self.backend.event("after-data")
            if job.fill is not None:  # the snapshot's whole copy, not only the bytes this rank read:
                job.fill.wait_all()  # a copy that failed fails the save on every rank
            job.metrics.write_s = time.perf_counter() - t0
            return RankReport(tuple(reports), objects, parts)
        finally:
            job.completion.staged()  # live tensors are no longer read (written, or failed)

    def _write_own(self, job: SaveJob, p: SavePlan, dirs: list[str]) -> tuple[list[FileReport], Objects]:
        """This rank's own files: its replicated slots, its skeleton copy, its rank_state, its
        DTensor pieces (each fsync'd)."""
        cfg = self._config()
        rep, own = p.replicated, p.own
        for d in dirs:
            try:
                self.backend.makedirs(d)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create {d}: {e.strerror or e}") from e
        reports: list[FileReport] = []
        objects: dict[str, tuple[list[str], list[int], list[mf.TensorEntry]]] = {}
        jobs = []
        for s, (r, j) in enumerate(p.slots):
            if r == self.rank:
                mine = [e for e in p.extents if e.slot == s]
                jobs.append((mine, j, os.path.join(dirs[j], f"{p.save_id}-{rep.name}-{s:04d}.bin")))
        if jobs:
            reports += write_slots(rep, jobs, self.backend, cfg)
        if self.skeleton_node is not None or (self.rank == 0 and not p.multi_node):
            copy = f"-n{self.skeleton_node:04d}" if self.skeleton_node is not None else ""
            path = os.path.join(dirs[0], f"{p.save_id}-{rep.name}{copy}.skel")
            reports.append(write_skeleton(rep, 0, path, self.backend))
            objects[rep.name] = (rep.keys, rep.sizes, rep.tensors)
        if own is not None:
            own_extents: list[Extent] = plan(own.sizes, len(self.roots))
            own_jobs = [([e for e in own_extents if e.slot == j], j,
                         os.path.join(dirs[j], f"{p.save_id}-{own.name}-{j:04d}.bin")) for j in range(len(self.roots))]
            reports += write_slots(own, own_jobs, self.backend, cfg)
            path = os.path.join(dirs[0], f"{p.save_id}-{own.name}.skel")
            reports.append(write_skeleton(own, 0, path, self.backend))
            objects[own.name] = (own.keys, own.sizes, own.tensors)
        reports += self._write_shards(p, job.shards, cfg)
        return reports, objects

    def write_replicated(self, plan: SavePlan, extents: Sequence[Extent], root: int, path: str) -> FileReport:
        """Write ``extents`` of the replicated state (slot ignored) into a new file ``path``."""
        ext = [Extent(x.storage, x.start, x.nbytes, 0) for x in extents]
        return write_slots(plan.replicated, [(ext, root, path)], self.backend, self._config())[0]

    def write_chunk_extents(self, plan: SavePlan, shards: Sequence[dtensor.LocalShard], extents: Sequence[Any],
                            root: int, path: str) -> FileReport:
        """Write extents of DTensor chunks this rank holds (an extent's ``storage`` is the
        chunk's index in the plan's layout) into a new file ``path``."""
        [report] = self._write_chunks(plan, shards, [(x.storage, x.start, x.nbytes) for x in extents],
                                      [(root, path)], self._config())
        return report

    def _write_shards(self, p: SavePlan, shards: list[dtensor.LocalShard], cfg: IOConfig) -> list[FileReport]:
        """Write this rank's pieces of the distinct chunks, balanced over the roots."""
        mine = [(x.chunk, x.start, x.nbytes) for x in p.layout.pieces if x.rank == self.rank]
        if not mine:
            return []
        files = [(j, os.path.join(root, p.directory, f"{p.save_id}-{mf.SHARDED}-r{self.rank:05d}-{j:04d}.bin"))
                 for j, root in enumerate(self.roots)]
        return self._write_chunks(p, shards, mine, files, cfg)

    def _write_chunks(self, plan: SavePlan, shards: Sequence[dtensor.LocalShard],
                      pieces: Sequence[tuple[int, int, int]], files: Sequence[tuple[int, str]],
                      cfg: IOConfig) -> list[FileReport]:
        """Write pieces (chunk index in the plan's layout, start in the chunk, bytes) of the
        DTensor chunks this rank holds, balanced over ``files`` ((root, path)); in the reports
        an extent's ``storage`` is the chunk's index."""
        local = {chunk_key(sh.meta): sh.tensor for sh in shards}
        chunks = sorted({c for c, _, _ in pieces})
        index = {c: i for i, c in enumerate(chunks)}
        tensors = [local[chunk_key(plan.layout.chunks[c])] for c in chunks]
        reports = write_chunks(mf.SHARDED, tensors, [(index[c], start, n) for c, start, n in pieces], files,
                               self.backend, cfg)
        return [dataclasses.replace(r, extents=tuple(dataclasses.replace(e, storage=chunks[e.storage])
                                                     for e in r.extents)) for r in reports]


def _results(besides: Sequence[tuple[str, Beside]]) -> list[tuple[str, Written]]:
    """What the work beside the writes wrote, once all of it has ended (the first failure is
    raised then: no work outlives the write phase)."""
    out: list[tuple[str, Written]] = []
    error: BaseException | None = None
    for name, beside in besides:
        try:
            out.append((name, beside.result()))
        except BaseException as e:  # noqa: BLE001 - raised once every other has ended
            error = error or e
    if error is not None:
        raise error
    return out


def _abandon(besides: Sequence[tuple[str, Beside]]) -> None:
    """This rank's writes failed: wait for the work beside them (its failure is secondary)."""
    for _, beside in besides:
        beside.abandon()
