"""Step 2 of the save protocol on one rank: write this rank's files.

Every writer rank writes its slots of the replicated state (one file per root, all at once),
every rank its own ``rank_state`` and its pieces of the DTensor chunks; every file is fsync'd,
then the directories. What it wrote is reported to the coordinator in a
:class:`~fastpersist.protocol.RankReport`. When the ranks check replication, the replicated
bytes (and the replicated DTensor chunks) are hashed in threads beside the writes.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastpersist import dtensor
from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointWriteError
from fastpersist.incremental import Reused, link_reused
from fastpersist.format import manifest as mf
from fastpersist.io.backend import FileBackend
from fastpersist.job import SaveJob
from fastpersist.objects.write import FileReport, write_chunks, write_skeleton, write_slots
from fastpersist.plan import Extent, plan
from fastpersist.protocol import RankReport, SavePlan
from fastpersist.nodes import Nodes
from fastpersist.partners import Receiver, Sender, Unique, partners, senders, unique_extents
from fastpersist.partners import exchange as copies_exchange
from fastpersist.replicas import ReplicaDigests, tensor_digest


class RankWriter:
    """Writes one rank's part of a checkpoint under ``roots``."""

    def __init__(self, rank: int, roots: Sequence[str], backend: FileBackend, config: Callable[[], IOConfig],
                 hash_replicas: bool, nodes: Nodes | None = None, redundancy: int = 1,
                 exchange: Callable[[list[Any], list[Any]], None] | None = None) -> None:
        self.rank = rank
        # several nodes with redundancy: the partners' copies of unique bytes (fastpersist.partners)
        self.nodes, self.redundancy, self.exchange = nodes, redundancy, exchange
        leads = nodes is not None and nodes.count > 1 and nodes.is_leader(rank)
        copying = nodes is not None and nodes.count > 1 and redundancy > 1
        self._partners = partners(nodes, rank, redundancy) if copying and nodes is not None else []
        self._senders = senders(nodes, rank, redundancy) if copying and nodes is not None else []
        # on several nodes: this rank's node if it is the node's leader (it writes the node's copy of
        # the replicated skeleton), else None; on one node rank 0 writes it
        self.skeleton_node = nodes.of_rank[rank] if leads and nodes is not None else None
        self.roots = list(roots)
        self.backend = backend
        self._config = config
        self.hash_replicas = hash_replicas
        self._links_refused: str | None = None  # this save's: why the filesystem refused a hard link

    def write(self, job: SaveJob, p: SavePlan) -> RankReport:
        """Write everything this rank owns of ``job``; the job is staged once the live
        tensors are no longer read (written, or the write failed)."""
        rep = p.replicated
        hashing = ReplicaDigests(rep) if self.hash_replicas else None
        # replicated shards are hashed beside the writes too (xxhash releases the GIL)
        chunk_hashing = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-hash") if self.hash_replicas else None
        t0 = time.perf_counter()
        try:
            chunks = chunk_hashing.submit(self._chunk_digests, job.shards, p.layout) if chunk_hashing else None
            report = self._write_files(job, p)
            if job.fill is not None:  # the snapshot's whole copy, not only the bytes this rank read:
                job.fill.wait_all()  # a copy that failed fails the save on every rank
            if hashing is not None and chunks is not None:
                report.digests = hashing.result()
                report.chunk_digests = chunks.result()
                job.metrics.replica_check_s = hashing.seconds
            job.metrics.write_s = time.perf_counter() - t0
            return report
        finally:
            if hashing is not None:
                hashing.join()
            if chunk_hashing is not None:
                chunk_hashing.shutdown(wait=True)
            job.completion.staged()  # live tensors are no longer read (written, or failed)

    def _write_files(self, job: SaveJob, p: SavePlan) -> RankReport:
        cfg = self._config()
        dirs = [os.path.join(root, p.directory) for root in self.roots]
        # the partners' copies first, beside every write of this rank's own: the exchange runs
        # all its rounds whatever happens here, so no rank is left waiting for a message
        copying = self._copy_unique(job, p, dirs)
        try:
            reports, objects = self._write_own(job, p, dirs, cfg)
        except BaseException:
            if copying is not None:
                copying.exception()  # its own failure is secondary to this one
            raise
        if copying is not None:
            reports += copying.result()
        for d in dirs:  # the new files' directory entries are durable too
            self.backend.fsync_dir(d)
        self.backend.event("after-data")
        refused, self._links_refused = self._links_refused, None
        return RankReport(reports, objects, links_refused=refused)

    def _write_own(self, job: SaveJob, p: SavePlan, dirs: list[str], cfg: IOConfig
                   ) -> tuple[list[FileReport], dict[str, tuple[list[str], list[int], list[mf.TensorEntry]]]]:
        """This rank's own files: its replicated slots, its skeleton copy, its rank_state, its
        DTensor pieces (each fsync'd)."""
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
        linking = [r for r in p.reused if r.rank == self.rank]
        if linking:  # incremental: the last checkpoint's files, named here too
            linked, self._links_refused = link_reused(linking, self.roots, p.directory, self.backend,
                                                      lambda r, path: self._write_again(p, job.shards, r, path, cfg))
            reports += linked
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

    def _copy_unique(self, job: SaveJob, p: SavePlan, dirs: list[str]) -> Future[list[FileReport]] | None:
        """Several nodes, redundancy > 1: send this rank's unique bytes to its partners and write
        the copies of its senders', in a thread beside the writes (see :mod:`fastpersist.partners`)."""
        if not p.multi_node or self.redundancy < 2 or self.nodes is None or self.exchange is None:
            return None
        roots = len(self.roots)

        def extents(rank: int) -> list[Unique]:
            return unique_extents(p.owns[rank], [x for x in p.layout.pieces if x.rank == rank], roots)

        mine = extents(self.rank)
        sender = Sender(mine, p.own, job.shards, p.layout) if mine else None
        node = self.nodes.of_rank[self.rank]
        receivers = [Receiver(k, ext, p.save_id, node, dirs, self.backend) for k in self._senders if (ext := extents(k))]
        to = self._partners
        exchange = self.exchange
        pool = ThreadPoolExecutor(1, thread_name_prefix="fastpersist-copies")
        try:
            return pool.submit(lambda: copies_exchange(exchange, sender, to, receivers))
        finally:
            pool.shutdown(wait=False)

    def _write_again(self, p: SavePlan, shards: list[dtensor.LocalShard], r: Reused, path: str,
                     cfg: IOConfig) -> FileReport:
        """An incremental save's reused extents whose file could not be linked, written into a
        new file at ``path`` (this rank holds their bytes: rank 0 the replicated state, a
        chunk's writer the chunk)."""
        if r.object == mf.REPLICATED:
            extents = [Extent(x.storage, x.start, x.nbytes, 0) for x in r.extents]
            return write_slots(p.replicated, [(extents, r.root, path)], self.backend, cfg)[0]
        local = {(sh.meta.path, sh.meta.offsets, sh.meta.sizes): sh.tensor for sh in shards}
        chunks = sorted({x.storage for x in r.extents})
        tensors = [local[(p.layout.chunks[c].path, p.layout.chunks[c].offsets, p.layout.chunks[c].sizes)]
                   for c in chunks]
        index = {c: i for i, c in enumerate(chunks)}
        [report] = write_chunks(mf.SHARDED, tensors, [(index[x.storage], x.start, x.nbytes) for x in r.extents],
                                [(r.root, path)], self.backend, cfg)
        return dataclasses.replace(report, extents=tuple(dataclasses.replace(e, storage=chunks[e.storage])
                                                         for e in report.extents))

    def _write_shards(self, p: SavePlan, shards: list[dtensor.LocalShard], cfg: IOConfig) -> list[FileReport]:
        """Write this rank's pieces of the distinct chunks, balanced over the roots; in the
        reports an extent's ``storage`` is the chunk's index in ``layout.chunks``."""
        chunks = p.layout.chunks
        mine = [piece for piece in p.layout.pieces if piece.rank == self.rank]
        if not mine:
            return []
        local = {(sh.meta.path, sh.meta.offsets, sh.meta.sizes): sh.tensor for sh in shards}
        tensors = [local[(chunks[x.chunk].path, chunks[x.chunk].offsets, chunks[x.chunk].sizes)] for x in mine]
        files = [(j, os.path.join(root, p.directory, f"{p.save_id}-{mf.SHARDED}-r{self.rank:05d}-{j:04d}.bin"))
                 for j, root in enumerate(self.roots)]
        reports = write_chunks(mf.SHARDED, tensors, [(i, x.start, x.nbytes) for i, x in enumerate(mine)],
                                       files, self.backend, cfg)
        # tensor index i -> chunk index
        return [dataclasses.replace(r, extents=tuple(dataclasses.replace(e, storage=mine[e.storage].chunk)
                                                     for e in r.extents)) for r in reports]

    @staticmethod
    def _chunk_digests(shards: list[dtensor.LocalShard], layout: dtensor.Layout) -> dict[int, int]:
        """xxh3-64 of every shard this rank holds that other ranks hold too (the replica check)."""
        index = {(c.path, c.offsets, c.sizes): i for i, c in enumerate(layout.chunks)}
        out = {}
        for sh in shards:
            c = index.get((sh.meta.path, sh.meta.offsets, sh.meta.sizes))
            if c is not None and len(layout.holders[c]) > 1:
                out[c] = tensor_digest(sh.tensor)
        return out
