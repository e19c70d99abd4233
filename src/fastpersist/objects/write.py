"""Writing an object of a sharded checkpoint: serialize it, place its extents in files, write
them all at once, and report where every extent landed.

An object (the replicated state, a rank's own state) is serialized once by torch into a
skeleton and storages (:func:`prepare`); the plan (:mod:`fastpersist.plan`) gives every writer
slot its extents; a rank writes each of its slots to one file on that slot's root, all slots at
once, through the pipelined writer. Inside its file a slot places each large extent at an
offset with the same alignment phase as the extent's memory (:func:`place`), so the extent's
middle goes straight from the tensor to the device with O_DIRECT and only its head and tail are
copied through the pool. A :class:`FileReport` says where every extent landed and its checksum;
the coordinator turns those into the manifest (:func:`build_object`, :func:`build_sharded`).
The DCP layer writes its files with the same placement and the same parallel file writer.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch
import xxhash

from fastpersist.config import IOConfig
from fastpersist.objects.dtensor import Layout, tensor_index
from fastpersist.errors import CheckpointWriteError, UnsaveableObjectError
from fastpersist.format import manifest as mf
from fastpersist.format import skeleton, torchzip
from fastpersist.format.template import Templates
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import ALIGN, BufferPool, align_up, shared_pool
from fastpersist.io.files import preallocate
from fastpersist.io.writer import Piece, write_pieces
from fastpersist.objects.files import ELEMENT_ALIGN
from fastpersist.plan import Extent, plan

T = TypeVar("T")

# Extents at least this large are placed at an offset matching their memory's alignment phase
# (costs at most ALIGN - 1 bytes of padding); smaller ones are packed back to back.
_PHASE_MIN = 64 * 1024


@dataclass
class Prepared:
    """One object, serialized: its skeleton file's bytes and its storages in pickler order."""

    name: str
    skeleton: bytes
    keys: list[str]
    storages: list[torch.UntypedStorage]
    sizes: list[int]
    tensors: list[mf.TensorEntry] = dataclasses.field(default_factory=list)  # by key path
    templated: bool = False  # its skeleton was written from a template, not pickled

    @functools.cached_property
    def skeleton_checksum(self) -> int:
        return xxhash.xxh3_64_intdigest(self.skeleton)


def prepare(name: str, obj: object, templates: Templates | None = None) -> Prepared:
    """Serialize ``obj`` with torch's pickle format (storages kept as references, never copied).

    With ``templates``, a structure saved before under ``name`` is written from its template
    instead of pickled (fastpersist.format.template), and a new one is learnt."""
    filled, walk = templates.fill(name, obj) if templates is not None else (None, None)
    if filled is not None:
        small, keys, storages, tensors = filled.records, filled.keys, filled.storages, filled.tensors
    else:
        try:
            small, keys, storages = skeleton.serialize(obj)
        except Exception as e:
            raise UnsaveableObjectError(f"the object cannot be serialized: {type(e).__name__}: {e}") from e
        tensors = tensor_index(obj, keys, storages)
        if templates is not None and walk is not None:
            templates.learn(name, obj, walk, small, keys, storages, tensors)
    return Prepared(name=name, skeleton=skeleton.encode(small), keys=keys, storages=storages,
                    sizes=[s.nbytes() for s in storages], tensors=tensors, templated=filled is not None)


@dataclass(frozen=True)
class PlacedExtent:
    """Where a writer put an extent: (storage index, start, nbytes, file offset, checksum)."""

    storage: int
    start: int
    nbytes: int
    offset: int
    checksum: int


@dataclass(frozen=True)
class FileReport:
    """One file a rank wrote: which object, on which root, and what it holds."""

    object: str
    root: int
    name: str
    size: int
    extents: tuple[PlacedExtent, ...]
    skeleton_checksum: int | None = None  # set for a skeleton file
    linked: bool = False  # an earlier checkpoint's file given a name in this one (incremental saves)


def _placement(prepared: Prepared, extents: Sequence[Extent]) -> tuple[list[Piece], list[tuple[Extent, int]], int]:
    """Pieces for one slot's file, each extent's offset, and the file size."""
    pos = 0
    pieces: list[Piece] = []
    placed: list[tuple[Extent, int]] = []
    for k, e in enumerate(extents):
        storage = prepared.storages[e.storage]
        on_cpu = storage.device.type == "cpu"
        pos = place(pos, e.nbytes, storage.data_ptr() + e.start if on_cpu else None)
        if on_cpu:  # host memory is described by its address (the Prepared keeps it alive)
            pieces.append(Piece(pos, e.nbytes, tag=k, addr=storage.data_ptr() + e.start))
        else:
            pieces.append(Piece(pos, e.nbytes, tensor=torchzip.byte_view(storage)[e.start : e.end], tag=k))
        placed.append((e, pos))
        pos += e.nbytes
    return pieces, placed, pos


def place(pos: int, nbytes: int, addr: int | None) -> int:
    """The file offset, at or after ``pos``, for ``nbytes`` of memory at ``addr`` (None: not
    host memory). A large piece of host memory keeps its 4 KiB phase, so its middle goes to the
    device with O_DIRECT without a copy (at most ALIGN - 1 bytes of padding); a large device
    piece starts aligned; small pieces are packed on element-safe boundaries (a reader can map
    them straight from one read)."""
    if nbytes < _PHASE_MIN:
        return align_up(pos, ELEMENT_ALIGN)
    offset = pos - pos % ALIGN + (addr % ALIGN if addr is not None else 0)
    return offset if offset >= pos else offset + ALIGN


def write_file(prepared: Prepared, extents: Sequence[Extent], root: int, path: str,
               backend: FileBackend, config: IOConfig, pool: BufferPool) -> FileReport:
    """Write one slot's extents to a new file at ``path`` and fsync it."""
    pieces, placed, size = _placement(prepared, extents)
    digests = write_new_file(path, pieces, size, root, backend, config, pool)
    return FileReport(
        prepared.name, root, os.path.basename(path), size,
        tuple(PlacedExtent(e.storage, e.start, e.nbytes, off, digests[k]) for k, (e, off) in enumerate(placed)),
    )


def write_new_file(path: str, pieces: Sequence[Piece], size: int, root: int, backend: FileBackend,
                   config: IOConfig, pool: BufferPool) -> dict[Hashable, int]:
    """Create ``path`` (``size`` bytes, preallocated), write ``pieces`` through the pipelined
    engine and fsync it; returns the tagged pieces' checksums. Errors name the file."""
    try:
        file = backend.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, config.direct, root)
    except OSError as e:
        raise CheckpointWriteError(f"cannot create {path}: {e.strerror or e}") from e
    try:
        preallocate(file.fd, size)
        digests = write_pieces(file, pieces, config, pool)
        backend.fsync(file)
    except CheckpointWriteError:
        raise
    except OSError as e:
        raise CheckpointWriteError(f"writing {path} failed: {e.strerror or e}") from e
    finally:
        file.close()
    return digests


def lane_config(config: IOConfig, lanes: int) -> IOConfig:
    """The configuration of one of ``lanes`` files written at once.

    The staging memory of one save stays ``chunk_bytes x num_buffers`` whatever the number of
    files: each file gets its own buffers of ``chunk_bytes / lanes`` (at least 1 MiB), so a file
    whose root is slow never holds the buffers another file needs.
    """
    if lanes <= 1:
        return config
    chunk = max(1 << 20, (config.chunk_bytes // lanes) // ALIGN * ALIGN)
    return dataclasses.replace(config, chunk_bytes=chunk)


def write_slots(prepared: Prepared, jobs: Sequence[tuple[Sequence[Extent], int, str]],
                backend: FileBackend, config: IOConfig) -> list[FileReport]:
    """Write several slot files at once; ``jobs`` holds (extents, root, path) per slot."""
    def one(lane: int, cfg: IOConfig, pool: BufferPool) -> FileReport:
        extents, root, path = jobs[lane]
        return write_file(prepared, extents, root, path, backend, cfg, pool)

    return files_at_once(len(jobs), config, one)


def lane_pools(config: IOConfig, count: int) -> tuple[IOConfig, list[BufferPool]]:
    """The configuration and the process-wide staging pools of ``count`` files written at once."""
    cfg = lane_config(config, count)
    return cfg, [shared_pool(cfg.chunk_bytes, cfg.num_buffers, lane) for lane in range(count)]


def prepare_lanes(config: IOConfig, count: int) -> None:
    """Make every staging buffer of ``count`` files written at once ready (BufferPool.prepare)."""
    for pool in lane_pools(config, count)[1]:
        pool.prepare()


def files_at_once(count: int, config: IOConfig, one: Callable[[int, IOConfig, BufferPool], T]) -> list[T]:
    """Run ``one(lane, lane's config, lane's staging pool)`` for ``count`` files at once (one
    thread each, each file with its own writer threads and staging buffers, see
    :func:`lane_config`); returns the results in lane order, or raises the first failure after
    every file has stopped."""
    cfg, pools = lane_pools(config, count)

    def run(lane: int) -> T:
        return one(lane, cfg, pools[lane])

    if count == 1:
        return [run(0)]
    with ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="fastpersist-file") as ex:
        futures = [ex.submit(run, lane) for lane in range(count)]
        return [fut.result() for fut in futures]


# A sharded tensor's chunk is cut into extents of at most this many bytes: a load that needs
# part of a chunk (resharding) reads and verifies whole extents, so they stay moderate.
CHUNK_EXTENT_MAX = 8 << 20


def write_chunks(name: str, tensors: Sequence[torch.Tensor], pieces: Sequence[tuple[int, int, int]],
                 files: Sequence[tuple[int, str]], backend: FileBackend, config: IOConfig) -> list[FileReport]:
    """Write byte ranges of contiguous tensors, balanced over ``files`` (root, path): one file
    per root, all at once. ``pieces`` are (tensor index, start, nbytes); in the reports an
    extent's ``storage`` is the tensor index and ``start`` counts from the tensor's first byte."""
    storages = [t.untyped_storage() for t in tensors]
    bases = [int(t.storage_offset()) * t.element_size() for t in tensors]
    cut = chunk_extents(pieces, len(files))
    jobs = []
    for slot, (root, path) in enumerate(files):
        mine = [dataclasses.replace(e, start=bases[e.storage] + e.start) for e in cut if e.slot == slot]
        if mine:
            jobs.append((mine, root, path))
    if not jobs:
        return []
    prepared = Prepared(name, b"", [], storages, [s.nbytes() for s in storages])
    return [dataclasses.replace(r, extents=tuple(dataclasses.replace(p, start=p.start - bases[p.storage])
                                                 for p in r.extents))
            for r in write_slots(prepared, jobs, backend, config)]


def chunk_extents(pieces: Sequence[tuple[int, int, int]], files: int) -> list[Extent]:
    """How :func:`write_chunks` cuts ``pieces`` (tensor index, start, nbytes) into extents over
    ``files`` files: at most :data:`CHUNK_EXTENT_MAX` bytes each, balanced; an extent's
    ``storage`` is the tensor index and ``start`` the byte from the tensor's first."""
    subs = [(i, s, min(CHUNK_EXTENT_MAX, start + n - s))
            for i, start, n in pieces for s in range(start, start + n, CHUNK_EXTENT_MAX)]
    return [Extent(subs[e.storage][0], subs[e.storage][1] + e.start, e.nbytes, e.slot)
            for e in plan([n for _, _, n in subs], files)]


def write_skeleton(prepared: Prepared, root: int, path: str, backend: FileBackend) -> FileReport:
    try:
        backend.write_small(path, prepared.skeleton, root)
    except OSError as e:
        raise CheckpointWriteError(f"cannot write {path}: {e.strerror or e}") from e
    return FileReport(prepared.name, root, os.path.basename(path), len(prepared.skeleton), (),
                      prepared.skeleton_checksum)


def build_object(prepared_keys: Sequence[str], sizes: Sequence[int], skeleton_files: Sequence[int],
                 skeleton_report: FileReport, data: Sequence[tuple[int, FileReport]],
                 tensors: Sequence[mf.TensorEntry] = (), files: Sequence[mf.FileEntry] = ()) -> mf.ObjectEntry:
    """The manifest entry of one object from the reports of the files that hold it.

    ``data`` pairs each data file's index in the manifest's file list with its report;
    ``skeleton_files`` are the indices of the skeleton's copies (one per node). Extents written
    more than once (copies on several nodes, see :mod:`fastpersist.topology`) become one extent
    with its ``copies``.
    """
    per_storage: list[list[mf.ExtentEntry]] = [[] for _ in sizes]
    for index, report in data:
        for p in report.extents:
            per_storage[p.storage].append(mf.ExtentEntry(index, p.offset, p.start, p.nbytes, p.checksum))
    storages = tuple(
        mf.StorageEntry(key, size, merge_copies(per_storage[i], files))
        for i, (key, size) in enumerate(zip(prepared_keys, sizes))
    )
    if skeleton_report.skeleton_checksum is None:
        raise CheckpointWriteError(f"{skeleton_report.name} is not a skeleton file")
    sk = mf.ExtentEntry(skeleton_files[0], 0, 0, skeleton_report.size, skeleton_report.skeleton_checksum,
                        tuple((f, 0) for f in skeleton_files[1:]))
    return mf.ObjectEntry(sk, storages, tuple(tensors))


def merge_copies(extents: Sequence[mf.ExtentEntry], files: Sequence[mf.FileEntry] = ()) -> tuple[mf.ExtentEntry, ...]:
    """Extents by start; those with the same start and length (copies of the same bytes, on
    distinct nodes) become one, the copy on the lowest node first."""
    def node(e: mf.ExtentEntry) -> int:
        return files[e.file].node if files else 0

    out: list[mf.ExtentEntry] = []
    for e in sorted(extents, key=lambda e: (e.start, node(e), e.file)):
        last = out[-1] if out else None
        if last is not None and last.start == e.start and last.nbytes == e.nbytes:
            if last.checksum != e.checksum:
                names = [files[x.file].name if files else str(x.file) for x in (last, e)]
                raise CheckpointWriteError(f"two copies of the same bytes differ: {e.nbytes} bytes from byte {e.start} "
                                           f"in {names[0]} and {names[1]} have checksums {last.checksum:016x} and "
                                           f"{e.checksum:016x} (the ranks' replicated state differs, or a copy was "
                                           "damaged on its way to another node)")
            out[-1] = dataclasses.replace(last, copies=(*last.copies, (e.file, e.offset)))
        else:
            out.append(e)
    return tuple(out)


def build_sharded(layout: Layout, data: Sequence[tuple[int, FileReport]],
                  files: Sequence[mf.FileEntry] = ()) -> tuple[mf.ShardedEntry, ...]:
    """The manifest's sharded tensors from the layout and the reports of the files holding
    their chunks (an extent's ``storage`` is its chunk's index)."""
    chunks = layout.chunks
    per_chunk: list[list[mf.ExtentEntry]] = [[] for _ in chunks]
    for index, report in data:
        for p in report.extents:
            per_chunk[p.storage].append(mf.ExtentEntry(index, p.offset, p.start, p.nbytes, p.checksum))
    by_path: dict[tuple[str | int, ...], list[mf.ChunkEntry]] = {p: [] for p, _, _ in layout.tensors}
    for m, extents in zip(chunks, per_chunk):
        by_path[m.path].append(mf.ChunkEntry(m.offsets, m.sizes, merge_copies(extents, files)))
    return tuple(mf.ShardedEntry(p, dtype, shape, tuple(by_path[p])) for p, dtype, shape in layout.tensors)
