"""Incremental checkpoints: bytes of the replicated state that did not change since the last
committed checkpoint are not written again.

The replicated state's storages are cut into **units** of at most :data:`BLOCK` bytes (4 MiB;
``Checkpointer(incremental=65536)`` asks for smaller ones, for tables whose updated rows are
scattered); a storage smaller than that is one unit. At each save every rank looks at its
share of the units (unit ``u`` belongs to rank ``u % world``, so the work is spread like the
writes):

1. a **sample** of the unit (:data:`SAMPLES` 8-byte words at fixed positions) is compared with
   the one taken at the last commit; if it differs, the unit changed (certainly: the same
   positions hold other bytes) and nothing else is computed. Training that updates every
   parameter changes every sample, so a full-training save pays only for the samples. (A
   unit under :data:`SAMPLE_MIN` bytes goes straight to step 2: hashing it costs less.)
2. if the sample is the same, the unit's **xxh3-128** digest is computed (about 11 GB/s on one
   core here, outside the GIL) and compared with the one taken at the last commit. Equal
   digests mean the unit is unchanged: its bytes are not written, the new checkpoint uses
   the copy the last checkpoint holds.

A false match needs two different contents of one unit, in consecutive saves, with the same
sample and the same 128-bit digest; for data nobody crafted that is 2^-128 per unit and save.
xxh3 is not a cryptographic hash: a party that can choose a tensor's bytes could make a new
content collide with the old one, and the checkpoint would then hold the old bytes; such a
party already controls what the checkpoint holds. (Documented in docs/DESIGN.md.)

**Where reused bytes live.** Nothing in a checkpoint points into another checkpoint's
directory. The files of the last checkpoint that hold reused units get a second name in the
new checkpoint's directory (a hard link, made by rank 0 before the commit), and the new
manifest lists them like any data file: the format does not change, every reader reads an
incremental checkpoint, and deleting any checkpoint (retention, crash clean-up, a user's
``rm -r``) removes names, never bytes another checkpoint still names. A linked file
also holds bytes of units that did change, which no extent of the new checkpoint claims; a
file is linked only if the units reused from it cover at least half of its size (otherwise
they are written again), so the space held by stale bytes is bounded. When a link cannot be
made (the last checkpoint was removed meanwhile), the linking rank writes those units instead:
the save never fails for it; a filesystem that refuses hard links turns incremental saves off.

**DTensor chunks** (FSDP2, tensor parallel) are units of their own, whole: each holder probes
the chunks it holds; a chunk is reused only if every holder found it unchanged, and the file
holding it is linked by the rank that wrote it (which holds the chunk, and writes it again if
the link fails).

Scope: a job on one node (or roots on one shared filesystem); host memory only (a unit in
device memory is always written); ``rank_state`` is always written. The reference is the last
checkpoint this Checkpointer committed into its roots; the first save of a process writes
everything.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import xxhash

from fastpersist.objects.dtensor import Layout, LocalShard
from fastpersist.format import manifest as mf
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import memory_view
from fastpersist.errors import CheckpointWriteError
from fastpersist.objects.write import FileReport, PlacedExtent, Prepared
from fastpersist.plan import Extent, plan
from fastpersist.saving.extension import Extension, Writer, Written, parts_of
from fastpersist.saving.messages import ChunkKey, Proposal, RankReport, SavePlan

if TYPE_CHECKING:
    from fastpersist.saving.job import SaveJob

logger = logging.getLogger(__name__)

BLOCK = 4 << 20  # a unit's size by default: what one reuse decision covers
MIN_BLOCK = 64 << 10  # smaller units would make manifests large and writes small
MAX_UNITS = 1 << 18  # beyond, units grow (a manifest stays far below what readers accept: ~90 bytes a unit)
SAMPLES = 16  # 8-byte words compared before a unit is hashed
SAMPLE_MIN = 64 << 10  # a smaller unit is hashed at once (cheaper than taking its sample)

FileKey = tuple[int, str]  # (root, file name in the checkpoint's directory)
T = TypeVar("T")


MAX_BACKOFF = 4  # a unit changing where its samples do not look is hashed at least every 2^4 + 1 saves


class Seen(NamedTuple):
    """What a rank knew of one of its units (or chunks) at the last commit."""

    sample: bytes
    digest: int | None  # None: not hashed then
    misses: int  # changes in a row that only the digest saw
    wait: int  # saves left that write it without hashing


@dataclass(frozen=True)
class Unit:
    storage: int
    start: int
    nbytes: int


def units_of(sizes: Sequence[int], block: int = BLOCK) -> list[Unit]:
    """The replicated state's units: every storage cut into ``block``-byte pieces (the last shorter)."""
    out = []
    for s, size in enumerate(sizes):
        for start in range(0, size, block):
            out.append(Unit(s, start, min(block, size - start)))
    return out


def block_size(incremental: bool | int) -> int | None:
    """The unit size ``Checkpointer(incremental=...)`` asks for (None: not incremental)."""
    if isinstance(incremental, bool):
        return BLOCK if incremental else None
    if not isinstance(incremental, int):
        raise TypeError(f"incremental must be True, False or a unit size in bytes, got {incremental!r}")
    if incremental < MIN_BLOCK or incremental % 4096:
        raise ValueError(f"incremental's unit size must be a multiple of 4096 bytes, at least {MIN_BLOCK}, "
                         f"got {incremental}")
    return incremental


@dataclass(frozen=True)
class Reused:
    """A file of the last checkpoint given a name in the new one, and the extents it serves."""

    object: str  # mf.REPLICATED or mf.SHARDED
    rank: int  # who links it (and writes its extents if it cannot): rank 0, or the chunks' writer
    root: int
    directory: str  # the last checkpoint's directory in that root
    source: str  # the file's name there
    name: str  # its name in the new checkpoint
    size: int
    extents: tuple[PlacedExtent, ...]  # for a sharded file, ``storage`` is the chunk's index in the new layout


Where = list[tuple[FileKey, PlacedExtent]]


@dataclass(frozen=True)
class Reference:
    """The last committed checkpoint, as every rank knows it (built alike from the reports)."""

    directory: str
    sizes: tuple[int, ...]
    files: dict[FileKey, tuple[int, int]]  # every data file that can be reused: (size, its writer rank)
    where: list[Where]  # per replicated unit, the extents holding its bytes
    chunks: dict[ChunkKey, Where]  # per DTensor chunk, the extents holding its bytes


def _keep(candidates: dict[T, Where], files: dict[FileKey, tuple[int, int]]) -> set[T]:
    """The candidates whose files are worth linking: a file is linked only if the reused
    extents cover at least half of it (else its stale bytes would be kept for little)."""
    keep = set(candidates)
    while keep:
        served: dict[FileKey, int] = defaultdict(int)
        for c in keep:
            for key, e in candidates[c]:
                served[key] += e.nbytes
        poor = {key for key, n in served.items() if 2 * n < files[key][0]}
        if not poor:
            break
        keep = {c for c in keep if not any(key in poor for key, _ in candidates[c])}
    return keep


def _reused(obj: str, ref: Reference, save_id: str, served: dict[FileKey, list[PlacedExtent]],
            rank: Callable[[FileKey], int]) -> list[Reused]:
    return [Reused(obj, rank(key), key[0], ref.directory, key[1], f"{save_id}-{obj}-reused-{k:04d}.bin",
                   ref.files[key][0], tuple(served[key])) for k, key in enumerate(sorted(served))]


def _sample(data: memoryview) -> bytes:
    """SAMPLES 8-byte words spread evenly over ``data`` (all of it when that is shorter)."""
    n = len(data)
    if n <= 8 * SAMPLES:
        return bytes(data)
    step = (n - 8) / (SAMPLES - 1)
    return b"".join(data[int(i * step) : int(i * step) + 8] for i in range(SAMPLES))


class Incremental:
    """One rank's part of incremental saving: probing its units, planning, learning each commit."""

    def __init__(self, rank: int, world: int, block: int = BLOCK, *, reference: Reference | None = None) -> None:
        self.rank, self.world, self.block = rank, world, block
        self._units: tuple[tuple[int, ...], list[Unit]] = ((), [])  # the last sizes' units
        self._unit_block = block  # their size (larger than ``block`` for a very large state)
        self.disabled = False  # the filesystem refused hard links
        self._ref = reference  # the last commit's (learnt at each commit; given here to plan against one)
        # (sample, digest) at the last commit, of this rank's units and of the chunks it holds
        self._seen: dict[int | ChunkKey, Seen] = {}
        self._pending: dict[int | ChunkKey, Seen] = {}  # this save's, adopted at its commit

    def units(self, sizes: Sequence[int]) -> list[Unit]:
        """:func:`units_of` these sizes (the same every save of one state: kept). A state that
        would have more than MAX_UNITS units gets larger ones (every rank alike)."""
        key = tuple(sizes)
        if self._units[0] != key:
            per_unit = -(-sum(key) // MAX_UNITS)
            block = max(self.block, -(-per_unit // 4096) * 4096)
            if block != self.block:
                logger.info("incremental checkpoint: units of %d bytes for this %d-byte state (at most %d units)",
                            block, sum(key), MAX_UNITS)
            self._units = (key, units_of(key, block))
            self._unit_block = block
        return self._units[1]

    @property
    def has_reference(self) -> bool:
        return self._ref is not None and not self.disabled

    def disable(self, why: str) -> None:
        """Every rank alike, once a link was refused by the filesystem: saves write everything."""
        if not self.disabled and self.rank == 0:
            logger.warning("incremental checkpoints are off for this Checkpointer: %s; every save writes all its "
                           "bytes from now on", why)
        self.disabled = True
        self.forget()

    def _unchanged(self, key: int | ChunkKey, data: memoryview, seen: Mapping[int | ChunkKey, Seen],
                   pending: dict[int | ChunkKey, Seen]) -> bool:
        """Whether ``data`` equals what ``key`` held at the last commit (sample, then digest).

        A unit whose changes the samples keep missing (sparse updates: an embedding block with
        a few new rows) is hashed for nothing, save after save; after its m-th such change in
        a row it is written without hashing for the next 2^m - 1 saves (m at most 4), then
        looked at again, so the hashing it costs falls to about 2 saves in 17, and a unit that
        stops changing is reused again within 18 saves."""
        sample = _sample(data) if len(data) >= SAMPLE_MIN else b""
        old = seen.get(key)
        if old is not None and old.sample != sample:  # certainly changed, at no cost
            pending[key] = Seen(sample, None, old.misses, 0)
            return False
        misses, wait = (old.misses, old.wait) if old is not None else (0, 0)
        if wait:
            pending[key] = Seen(sample, None, misses, wait - 1)
            return False
        digest = xxhash.xxh3_128_intdigest(data)
        if old is not None and old.digest is not None and old.digest != digest:  # a change the sample missed
            misses += 1
            pending[key] = Seen(sample, digest, misses, (1 << min(misses, MAX_BACKOFF)) - 1)
            return False
        same = old is not None and old.digest == digest
        pending[key] = Seen(sample, digest, 0 if same else misses, 0)
        return same

    def probe(self, prepared: Prepared, shards: Sequence[LocalShard] = ()) -> tuple[list[int], list[ChunkKey]]:
        """Step 1 on this rank: its replicated units, and the DTensor chunks it holds, that are
        unchanged since the last commit."""
        if self.disabled:
            return [], []
        ref = self._ref
        same = ref is not None and ref.sizes == tuple(prepared.sizes)
        pending: dict[int | ChunkKey, Seen] = {}
        units_out: list[int] = []
        units = self.units(prepared.sizes)
        for u in range(self.rank, len(units), self.world):
            unit = units[u]
            storage = prepared.storages[unit.storage]
            if storage.device.type != "cpu":
                continue
            data = memory_view(storage.data_ptr() + unit.start, unit.nbytes)  # the Prepared keeps it alive
            if self._unchanged(u, data, self._seen if same else {}, pending) and ref is not None and ref.where[u]:
                units_out.append(u)
        chunks_out: list[ChunkKey] = []
        for sh in shards:
            key = (sh.meta.path, sh.meta.offsets, sh.meta.sizes)
            if sh.tensor.device.type != "cpu" or not sh.meta.nbytes or not sh.tensor.is_contiguous():
                continue
            data = memory_view(sh.tensor.data_ptr(), sh.meta.nbytes)  # the job keeps it alive
            if self._unchanged(key, data, self._seen, pending) and ref is not None and key in ref.chunks:
                chunks_out.append(key)
        self._pending = pending
        return units_out, chunks_out

    def plan(self, sizes: Sequence[int], unchanged: set[int], slots: int, save_id: str
             ) -> tuple[list[Extent], list[Reused]]:
        """The replicated bytes to write over the slots, and the last checkpoint's files to link
        (by rank 0). Every rank computes the same from the same reference and the union of the
        probes."""
        units = self.units(sizes)
        ref = self._ref if self._ref is not None and self._ref.sizes == tuple(sizes) and not self.disabled else None
        keep = _keep({u: ref.where[u] for u in unchanged if ref.where[u]}, ref.files) if ref is not None else set()
        virtual = [0 if u in keep else unit.nbytes for u, unit in enumerate(units)]
        extents = [Extent(units[e.storage].storage, units[e.storage].start + e.start, e.nbytes, e.slot)
                   for e in plan(virtual, slots)]
        if ref is None or not keep:
            return extents, []
        served: dict[FileKey, list[PlacedExtent]] = defaultdict(list)
        for u in sorted(keep):
            for key, e in ref.where[u]:
                served[key].append(e)
        return extents, _reused(mf.REPLICATED, ref, save_id, served, lambda key: 0)

    def plan_chunks(self, layout: Layout, unchanged: Sequence[set[ChunkKey]], save_id: str
                    ) -> tuple[Layout, list[Reused]]:
        """The layout without the chunks every holder found unchanged, and the last checkpoint's
        files holding them (each linked by the rank that wrote it, which holds those chunks)."""
        ref = self._ref
        if ref is None or self.disabled:
            return layout, []
        keys = [(m.path, m.offsets, m.sizes) for m in layout.chunks]
        # reused only if every holder found it unchanged, and every file holding it was written
        # by a rank that still holds it (that rank links the file, or writes the chunk again)
        candidates = {c: ref.chunks[k] for c, k in enumerate(keys)
                      if k in ref.chunks and all(k in unchanged[r] for r in layout.holders[c])
                      and all(ref.files[f][1] in layout.holders[c] for f, _ in ref.chunks[k])}
        keep = _keep(candidates, ref.files)
        if not keep:
            return layout, []
        served: dict[FileKey, list[PlacedExtent]] = defaultdict(list)
        for c in sorted(keep):
            for key, e in ref.chunks[keys[c]]:
                served[key].append(dataclasses.replace(e, storage=c))
        pieces = [x for x in layout.pieces if x.chunk not in keep]
        return (Layout(layout.tensors, layout.chunks, pieces, layout.holders),
                _reused(mf.SHARDED, ref, save_id, served, lambda key: ref.files[key][1]))

    def committed(self, directory: str, sizes: Sequence[int], layout: Layout, written: Sequence[RankReport]) -> None:
        """After a commit, on every rank alike: this checkpoint is the next save's reference."""
        units = self.units(sizes)
        first: list[int] = []  # each storage's first unit
        count = 0
        for size in sizes:
            first.append(count)
            count += -(-size // self._unit_block)
        where: list[Where] = [[] for _ in units]
        chunks: dict[ChunkKey, Where] = defaultdict(list)
        keys = [(m.path, m.offsets, m.sizes) for m in layout.chunks]
        files: dict[FileKey, tuple[int, int]] = {}
        for rank, w in enumerate(written):
            for r in w.reports:
                if r.skeleton_checksum is not None or r.object not in (mf.REPLICATED, mf.SHARDED):
                    continue
                files[(r.root, r.name)] = (r.size, rank)
                for e in r.extents:
                    if r.object == mf.REPLICATED:
                        where[first[e.storage] + e.start // self._unit_block].append(((r.root, r.name), e))
                    else:
                        chunks[keys[e.storage]].append(((r.root, r.name), e))
        self._ref = Reference(directory, tuple(sizes), files, where, dict(chunks))
        self._seen, self._pending = self._pending, {}

    def forget(self) -> None:
        """The next save writes everything (a save failed, or its checkpoint left the roots)."""
        self._ref = None
        self._seen, self._pending = {}, {}


# errnos of a filesystem that does not do hard links (as opposed to a file that went away)
LINKS_REFUSED = frozenset({errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS})


def link_reused(reused: Sequence[Reused], roots: Sequence[str], directory: str, backend: FileBackend,
                write: Callable[[Reused, str], FileReport]) -> tuple[list[FileReport], str | None]:
    """Step 2 on the rank each file names: give each file of ``reused`` its name in the new
    checkpoint. A file that cannot be linked (gone, not the size it had, a filesystem without
    hard links) has its extents written instead, by ``write(reused, path)``. Also returns why
    the filesystem refused links, if it did (the next saves then write everything)."""
    out: list[FileReport] = []
    refused: str | None = None
    for r in reused:
        src = os.path.join(roots[r.root], r.directory, r.source)
        dst = os.path.join(roots[r.root], directory, r.name)
        try:
            st = backend.stat(src, follow=False)
            if not stat.S_ISREG(st.st_mode) or st.st_size != r.size:
                raise OSError(f"{src} is no longer the file the last checkpoint wrote")
            backend.link(r.root, src, dst)
            out.append(FileReport(r.object, r.root, r.name, r.size, r.extents, linked=True))
        except OSError as e:
            logger.info("incremental checkpoint: cannot reuse %s (%s); writing its %d extent(s) again",
                        src, e.strerror or e, len(r.extents))
            if e.errno in LINKS_REFUSED:
                refused = f"linking {src} failed: {e.strerror or e}"
            out.append(write(r, dst))
    return out, refused


@dataclass(frozen=True)
class Probed:
    """A rank's part of an incremental save's proposal."""

    unit: int  # its Checkpointer's unit size (the ranks must agree)
    unchanged: tuple[int, ...] = ()  # its units unchanged since the last commit
    unchanged_chunks: tuple[ChunkKey, ...] = ()  # and the DTensor chunks it holds that are unchanged


class IncrementalSaves(Extension):
    """Incremental saves as an extension of the save (see the module): each rank probes its
    units in its proposal; the plan writes only the changed ones and names the last
    checkpoint's files to link; the linking rank links them after its own writes (or writes
    them again); the commit makes the checkpoint the next save's reference."""

    name = "incremental"
    option = "incremental"

    def __init__(self, rank: int, world: int, block: int = BLOCK) -> None:
        self.reuse = Incremental(rank, world, block)

    def propose(self, job: SaveJob) -> Probed:
        inc = self.reuse
        unchanged: tuple[list[int], list[ChunkKey]] = ([], [])
        # a directory save is no reference for the next save: probed only if it can reuse
        if job.prepared is not None and not inc.disabled and (job.directory is None or inc.has_reference):
            t0 = time.perf_counter()
            unchanged = inc.probe(job.prepared[0], job.shards)
            job.metrics.probe_s = time.perf_counter() - t0
        return Probed(inc.block, tuple(unchanged[0]), tuple(unchanged[1]))

    def plan(self, job: SaveJob, proposals: Sequence[Proposal], plan: SavePlan) -> SavePlan:
        probes: list[Probed | None] = parts_of(proposals, self.name)
        units = [p.unit if p is not None else 0 for p in probes]
        mixed = [r for r, u in enumerate(units) if u != units[0]]
        if mixed:
            raise CheckpointWriteError(
                f"checkpoint step {job.step}: the ranks' Checkpointers disagree on incremental=: rank {mixed[0]} uses "
                f"{units[mixed[0]] or 'off'}, rank 0 {units[0] or 'off'} (unit bytes); every rank constructs its "
                "Checkpointer with the same arguments")
        found = [p for p in probes if p is not None]
        extents, reused = self.reuse.plan(plan.replicated.sizes, {u for p in found for u in p.unchanged},
                                          len(plan.slots), plan.save_id)
        layout, chunks = self.reuse.plan_chunks(plan.layout, [set(p.unchanged_chunks) for p in found], plan.save_id)
        return dataclasses.replace(plan, extents=tuple(extents), layout=layout,
                                   parts={**plan.parts, self.name: reused + chunks})

    def write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Written | None:
        """Link the last checkpoint's files this rank names in the new one (or write their
        extents again); the part says why the filesystem refused a link, if it did."""
        linking = [r for r in plan.parts.get(self.name, ()) if r.rank == writer.rank]
        if not linking:
            return None

        def again(r: Reused, path: str) -> FileReport:
            if r.object == mf.REPLICATED:
                return writer.write_replicated(plan, [Extent(x.storage, x.start, x.nbytes, 0) for x in r.extents],
                                               r.root, path)
            return writer.write_chunk_extents(plan, job.shards, r.extents, r.root, path)

        files, refused = link_reused(linking, writer.roots, plan.directory, self.core.coordinator.backend, again)
        return Written(tuple(files), refused)

    def committed(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport], outcome: object) -> None:
        refused = next((p for p in parts_of(written, self.name) if p), None)
        if refused is not None:
            self.reuse.disable(refused)
        elif job.directory is None:
            self.reuse.committed(plan.directory, plan.replicated.sizes, plan.layout, written)
        else:  # a checkpoint moved out of the roots is no reference
            self.reuse.forget()

    def failed(self, job: SaveJob, plan: SavePlan, outcome: object) -> None:
        self.reuse.forget()
