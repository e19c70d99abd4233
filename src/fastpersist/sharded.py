"""Writing and reading the data of a sharded checkpoint (the Checkpointer's I/O half).

Writing: an object is serialized once by torch into a skeleton and storages
(:func:`prepare`); the plan (:mod:`fastpersist.plan`) gives every writer slot its extents; a rank
writes each of its slots to one file on that slot's root, all slots at once, through the
pipelined writer. Inside its file a slot places each large extent at an offset with the same
alignment phase as the extent's memory, so the extent's middle goes straight from the tensor to
the device with O_DIRECT and only its head and tail are copied through the pool. The result of
a write (:class:`FileReport`) says where every extent landed and its checksum; the coordinator
turns those into the manifest.

Reading: :func:`read_object` reads every extent of an object, in parallel, into one host
buffer laid out so that each large extent's file offset and memory address share their phase
(O_DIRECT again), verifies every checksum, and hands the buffer with the skeleton to torch's
loader; the object's tensors are views of that buffer, with no copy after the read.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from fastpersist.config import IOConfig
from fastpersist.dtensor import Layout, tensor_index
from fastpersist.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
    UnsaveableObjectError,
    UnverifiedCheckpointError,
)
from fastpersist.format import manifest as mf
from fastpersist.format import references, skeleton, torchzip
from fastpersist.io.backend import FileBackend
from fastpersist.io.buffers import ALIGN, BufferPool, align_up, memory_view, shared_pool
from fastpersist.io.files import DirectFile, file_size, preallocate
from fastpersist.io.reader import ReadFailedError, ReadRequest, allocate, read_into
from fastpersist.io.writer import Piece, write_pieces
from fastpersist.plan import Extent, plan

# Extents at least this large are placed at an offset matching their memory's alignment phase
# (costs at most ALIGN - 1 bytes of padding); smaller ones are packed back to back.
_PHASE_MIN = 64 * 1024
# Storages in the read buffer start on this boundary (enough for any dtype).
_ELEMENT_ALIGN = 64


@dataclass
class Prepared:
    """One object, serialized: its skeleton file's bytes and its storages in pickler order."""

    name: str
    skeleton: bytes
    keys: list[str]
    storages: list[torch.UntypedStorage]
    sizes: list[int]
    tensors: list[mf.TensorEntry] = dataclasses.field(default_factory=list)  # by key path

    @functools.cached_property
    def skeleton_checksum(self) -> int:
        return xxhash.xxh3_64_intdigest(self.skeleton)


def prepare(name: str, obj: object) -> Prepared:
    """Serialize ``obj`` with torch's pickle format (storages kept as references, never copied)."""
    try:
        small, keys, storages = skeleton.serialize(obj)
    except Exception as e:
        raise UnsaveableObjectError(f"the object cannot be serialized: {type(e).__name__}: {e}") from e
    return Prepared(name=name, skeleton=skeleton.encode(small), keys=keys, storages=storages,
                    sizes=[s.nbytes() for s in storages], tensors=tensor_index(obj, keys, storages))


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
        return align_up(pos, _ELEMENT_ALIGN)
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
    """Write several slot files at once (one thread each, each with its own writer threads
    and staging buffers); ``jobs`` holds (extents, root, path) per slot. Raises the first
    failure after every slot has stopped.
    """
    cfg = lane_config(config, len(jobs))

    def one(lane: int) -> FileReport:
        extents, root, path = jobs[lane]
        return write_file(prepared, extents, root, path, backend, cfg, shared_pool(cfg.chunk_bytes, cfg.num_buffers, lane))

    if len(jobs) == 1:
        return [one(0)]
    with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="fastpersist-slot") as ex:
        futures = [ex.submit(one, lane) for lane in range(len(jobs))]
        return [f.result() for f in futures]


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
    subs = [(i, s, min(CHUNK_EXTENT_MAX, start + n - s))
            for i, start, n in pieces for s in range(start, start + n, CHUNK_EXTENT_MAX)]
    jobs = []
    for slot, (root, path) in enumerate(files):
        mine = [Extent(subs[e.storage][0], bases[subs[e.storage][0]] + subs[e.storage][1] + e.start, e.nbytes, slot)
                for e in plan([n for _, _, n in subs], len(files)) if e.slot == slot]
        if mine:
            jobs.append((mine, root, path))
    if not jobs:
        return []
    prepared = Prepared(name, b"", [], storages, [s.nbytes() for s in storages])
    return [dataclasses.replace(r, extents=tuple(dataclasses.replace(p, start=p.start - bases[p.storage])
                                                 for p in r.extents))
            for r in write_slots(prepared, jobs, backend, config)]


def write_skeleton(prepared: Prepared, root: int, path: str, backend: FileBackend) -> FileReport:
    try:
        backend.write_small(path, prepared.skeleton, root)
    except OSError as e:
        raise CheckpointWriteError(f"cannot write {path}: {e.strerror or e}") from e
    return FileReport(prepared.name, root, os.path.basename(path), len(prepared.skeleton), (),
                      prepared.skeleton_checksum)


def build_object(prepared_keys: Sequence[str], sizes: Sequence[int], skeleton_file: int,
                 skeleton_report: FileReport, data: Sequence[tuple[int, FileReport]],
                 tensors: Sequence[mf.TensorEntry] = ()) -> mf.ObjectEntry:
    """The manifest entry of one object from the reports of the files that hold it.

    ``data`` pairs each data file's index in the manifest's file list with its report.
    """
    per_storage: list[list[mf.ExtentEntry]] = [[] for _ in sizes]
    for index, report in data:
        for p in report.extents:
            per_storage[p.storage].append(mf.ExtentEntry(index, p.offset, p.start, p.nbytes, p.checksum))
    storages = tuple(
        mf.StorageEntry(key, size, tuple(sorted(per_storage[i], key=lambda e: e.start)))
        for i, (key, size) in enumerate(zip(prepared_keys, sizes))
    )
    if skeleton_report.skeleton_checksum is None:
        raise CheckpointWriteError(f"{skeleton_report.name} is not a skeleton file")
    sk = mf.ExtentEntry(skeleton_file, 0, 0, skeleton_report.size, skeleton_report.skeleton_checksum)
    return mf.ObjectEntry(sk, storages, tuple(tensors))


def build_sharded(layout: Layout, data: Sequence[tuple[int, FileReport]]) -> tuple[mf.ShardedEntry, ...]:
    """The manifest's sharded tensors from the layout and the reports of the files holding
    their chunks (an extent's ``storage`` is its chunk's index)."""
    chunks = layout.chunks
    per_chunk: list[list[mf.ExtentEntry]] = [[] for _ in chunks]
    for index, report in data:
        for p in report.extents:
            per_chunk[p.storage].append(mf.ExtentEntry(index, p.offset, p.start, p.nbytes, p.checksum))
    by_path: dict[tuple[str | int, ...], list[mf.ChunkEntry]] = {p: [] for p, _, _ in layout.tensors}
    for m, extents in zip(chunks, per_chunk):
        by_path[m.path].append(mf.ChunkEntry(m.offsets, m.sizes, tuple(sorted(extents, key=lambda e: e.start))))
    return tuple(mf.ShardedEntry(p, dtype, shape, tuple(by_path[p])) for p, dtype, shape in layout.tensors)


# ---------------------------------------------------------------------------------------------
# Reading


def _file_path(dirs: Sequence[str], manifest: mf.Manifest, index: int) -> str:
    f = manifest.files[index]
    if f.root >= len(dirs):
        raise CheckpointReadError(
            f"{_manifest_path(dirs)}: the checkpoint's file {f.name!r} is on root #{f.root}, but only "
            f"{len(dirs)} roots were given: pass every root the checkpoint was written to"
        )
    return os.path.join(dirs[f.root], f.name)


def _manifest_path(dirs: Sequence[str]) -> str:
    return os.path.join(dirs[0], mf.MANIFEST_NAME)


# ---- the checks load and verify share -------------------------------------------------------
# Each raises a CheckpointError naming the file; read_object stops at the first, verify reports
# every one and goes on. Symbolic links: a checkpoint's files are opened with O_NOFOLLOW (their
# names are plain names, so no component inside a checkpoint directory can be a link) and must
# be regular files; the directories the caller names (roots, the checkpoint's directory) are
# the caller's and may be links.


def check_unverified(dirs: Sequence[str], manifest: mf.Manifest) -> None:
    """A version-1 manifest has no checksum of its own: under verification it is refused."""
    if manifest.version < 2:
        raise UnverifiedCheckpointError(
            f"{_manifest_path(dirs)} is format version {manifest.version}, whose manifest carries no checksum of "
            "its own, so its content cannot be verified; load it with verify=False, or load and save it again"
        )


def open_file(dirs: Sequence[str], manifest: mf.Manifest, index: int, direct: str,
              backend: FileBackend | None = None) -> DirectFile:
    """Open file ``index`` of the checkpoint: a regular file, not a link, at least its listed size."""
    file = _open_listed(dirs, manifest, index, direct, backend)
    try:
        check_size(file, manifest, index)
    except BaseException:
        file.close()
        raise
    return file


def _open_listed(dirs: Sequence[str], manifest: mf.Manifest, index: int, direct: str,
                 backend: FileBackend | None = None) -> DirectFile:
    path = _file_path(dirs, manifest, index)
    try:
        return (backend or FileBackend()).open_read(path, direct)
    except CheckpointNotFoundError as e:
        raise CorruptCheckpointError(f"{path} is missing: the checkpoint lists it, the directory lacks it") from e


def check_size(file: DirectFile, manifest: mf.Manifest, index: int) -> None:
    have, want = file_size(file.fd), manifest.files[index].size
    if have < want:
        raise CorruptCheckpointError(f"{file.path} is truncated: {have} bytes, the manifest says {want}")


def read_skeleton(path: str, file: DirectFile, manifest: mf.Manifest, name: str, verify: bool) -> dict[str, bytes]:
    """The skeleton records of object ``name``, bounded, checksummed, strictly decoded, and bound
    to the object's storages (every reference names a listed storage of exactly its size)."""
    entry = manifest.objects[name]
    size = entry.skeleton.nbytes
    if size > skeleton.MAX_SKELETON_BYTES:
        raise CorruptCheckpointError(f"{path}: the skeleton of object {name!r} is listed as {size} bytes, more "
                                     f"than a skeleton may be ({skeleton.MAX_SKELETON_BYTES})")
    if file_size(file.fd) != size:
        raise CorruptCheckpointError(f"{path}: the skeleton file is {file_size(file.fd)} bytes, the manifest "
                                     f"says {size}")
    raw = file.read_exact(entry.skeleton.offset, size)
    if verify and xxhash.xxh3_64_intdigest(raw) != entry.skeleton.checksum:
        raise ChecksumMismatchError(f"{path}: the skeleton of object {name!r} fails its checksum; the file is corrupt")
    small = skeleton.decode(path, raw)
    problems = references.binding_problems(small["data.pkl"], {s.key: s.nbytes for s in entry.storages})
    if problems:
        raise CorruptCheckpointError(f"{path}: object {name!r}: {problems[0]}"
                                     + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    return small


def extent_problem(dirs: Sequence[str], manifest: mf.Manifest, name: str, s: mf.StorageEntry,
                   e: mf.ExtentEntry, got: int) -> str | None:
    """What is wrong with one extent whose bytes hash to ``got`` (None if nothing)."""
    if got == e.checksum:
        return None
    return (f"{_file_path(dirs, manifest, e.file)}: object {name!r} {storage_name(manifest, name, s.key)} bytes "
            f"{e.start}..{e.start + e.nbytes} (file offset {e.offset}) fail their checksum "
            f"(stored {e.checksum:016x}, read {got:016x})")


def storage_name(manifest: mf.Manifest, name: str, key: str) -> str:
    """``storage '3' (tensor 'model.w')``: a storage with the key paths of the tensors it holds."""
    obj = manifest.objects.get(name)
    keys = [t.key for t in obj.tensors if t.storage == key] if obj is not None else []
    if not keys:
        return f"storage {key!r}"
    more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return f"storage {key!r} (tensor {keys[0]!r}{more})"


def _needed_files(manifest: mf.Manifest, names: Sequence[str], sharded: bool = False) -> list[int]:
    return sorted({e.file for n in names for s in manifest.objects[n].storages for e in s.extents}
                  | {manifest.objects[n].skeleton.file for n in names}
                  | ({e.file for t in manifest.sharded for c in t.chunks for e in c.extents} if sharded else set()))


# ---- load ------------------------------------------------------------------------------------


# Packed extents closer than this in a file are read with one request (the gap is read too).
_MERGE_GAP = 64 * 1024
# Files read at once (each with reader_threads requests in flight). Measured (0.5 GiB written by
# 4 ranks, cold cache, vs single-file load): 1 file 0.93, 2 files 0.96, 4 files 0.92.
_FILES_AT_ONCE = 2


def _read_plan(entry: mf.ObjectEntry) -> tuple[list[int], int, dict[int, list[tuple[int, int, int, int]]]]:
    """Where every storage goes in the read buffer, the buffer's size, and the reads.

    Storages held whole by one extent at an element-aligned offset are read *in runs*: the
    extents of a file that lie close together are read with one request into one area of the
    buffer that mirrors the file, so many small storages cost one large O_DIRECT read. A storage
    cut over several files gets its own area (at the phase of its largest extent, so its reads
    are O_DIRECT too). Reads are (file offset, nbytes, buffer offset, capacity) per file.
    """
    storages = entry.storages
    bases = [0] * len(storages)
    reads: dict[int, list[tuple[int, int, int, int]]] = {}
    pos = 0
    whole: dict[int, list[tuple[int, int, int]]] = {}  # file -> (offset, nbytes, storage)
    separate = []
    for i, s in enumerate(storages):
        if len(s.extents) == 1 and s.extents[0].offset % _ELEMENT_ALIGN == 0:
            e = s.extents[0]
            whole.setdefault(e.file, []).append((e.offset, e.nbytes, i))
        elif s.extents:
            separate.append(i)
    for f, spans in sorted(whole.items()):
        spans.sort()
        k = 0
        while k < len(spans):
            start, end, j = spans[k][0], spans[k][0] + spans[k][1], k + 1
            while j < len(spans) and spans[j][0] - end <= _MERGE_GAP:
                end = max(end, spans[j][0] + spans[j][1])
                j += 1
            area = align_up(pos) + start % ALIGN
            for offset, _, i in spans[k:j]:
                bases[i] = area + offset - start
            reads.setdefault(f, []).append((start, end - start, area, align_up(area + end - start) - area))
            pos = align_up(area + end - start)
            k = j
    for i in separate:
        s = storages[i]
        big = max(s.extents, key=lambda e: e.nbytes)
        base = align_up(pos) + (big.offset - big.start) % ALIGN
        bases[i] = base
        for e in s.extents:
            last = e.start + e.nbytes == s.nbytes  # only the last extent may read into the slack
            capacity = align_up(base + s.nbytes) - base - e.start if last else e.nbytes
            reads.setdefault(e.file, []).append((e.offset, e.nbytes, base + e.start, capacity))
        pos = align_up(base + s.nbytes)
    return bases, align_up(pos), reads


def read_object(dirs: Sequence[str], manifest: mf.Manifest, name: str, *, map_location: Any,
                weights_only: bool, verify: bool, config: IOConfig, backend: FileBackend | None = None) -> Any:
    """Read, verify and rebuild object ``name`` of a checkpoint whose directories are ``dirs``.

    Every file is opened (regular, not a link, at least its listed size) and the skeleton is
    checked against the storages before the read buffer is allocated, so a damaged manifest
    cannot make load allocate more than the files hold.
    """
    if name not in manifest.objects:
        raise CheckpointReadError(f"{_manifest_path(dirs)}: the checkpoint of step {manifest.step} holds no "
                                  f"object {name!r}")
    if verify:
        check_unverified(dirs, manifest)
    entry = manifest.objects[name]
    files: dict[int, DirectFile] = {}
    try:
        for index in _needed_files(manifest, [name]):
            files[index] = open_file(dirs, manifest, index, config.direct, backend)
        sk = entry.skeleton.file
        small = read_skeleton(_file_path(dirs, manifest, sk), files[sk], manifest, name, verify)
        bases, size, reads = _read_plan(entry)
        buf = allocate(_manifest_path(dirs), size)
        addr = buf.data_ptr()
        by_file = {f: [ReadRequest(off, n, addr + at, cap, fresh=True) for off, n, at, cap in rs]
                   for f, rs in reads.items()}
        try:
            _read_files(files, by_file, config)
        except ReadFailedError as e:  # name what lies where the read failed
            raise _name_failed_read(e, dirs, manifest, name, files) from e
    finally:
        for file in files.values():
            file.close()
    if verify:
        _verify(dirs, manifest, name, entry, bases, addr, config.reader_threads)
    shift = int(buf.storage_offset())  # the buffer is an aligned view into a larger allocation
    offsets = {f"data/{s.key}": base + shift for s, base in zip(entry.storages, bases)}
    return skeleton.rebuild(_manifest_path(dirs), skeleton.ArchiveView(small, offsets), buf.untyped_storage(),
                            map_location, weights_only)


def _name_failed_read(e: ReadFailedError, dirs: Sequence[str], manifest: mf.Manifest, name: str,
                      files: dict[int, DirectFile]) -> CheckpointReadError:
    """The read error with the storages whose bytes lie in the failed range."""
    index = next((i for i, f in files.items() if f.path == e.path), None)
    keys = [s.key for s in manifest.objects[name].storages for x in s.extents
            if x.file == index and x.offset < e.offset + e.nbytes and e.offset < x.offset + x.nbytes]
    what = f"object {name!r} storage{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys[:5]))}" if keys else \
        f"object {name!r}"
    return CheckpointReadError(f"{e} ({what} of checkpoint step {manifest.step})")


def _read_files(files: dict[int, DirectFile], by_file: dict[int, list[ReadRequest]], config: IOConfig) -> None:
    order = sorted(by_file)
    if len(order) <= 1:
        for f in order:
            read_into(files[f], by_file[f], config)
        return
    with ThreadPoolExecutor(max_workers=min(len(order), _FILES_AT_ONCE), thread_name_prefix="fastpersist-files") as ex:
        for fut in [ex.submit(read_into, files[f], by_file[f], config) for f in order]:
            fut.result()


def _verify(dirs: Sequence[str], manifest: mf.Manifest, name: str, entry: mf.ObjectEntry,
            bases: Sequence[int], addr: int, threads: int) -> None:
    def describe(s: mf.StorageEntry, e: mf.ExtentEntry) -> Callable[[int], str]:
        return lambda got: extent_problem(dirs, manifest, name, s, e, got) or ""

    check_in_memory([(addr + base + e.start, e, describe(s, e)) for s, base in zip(entry.storages, bases)
                     for e in s.extents], threads)


def check_in_memory(work: Sequence[tuple[int, mf.ExtentEntry, Callable[[int], str]]], threads: int) -> None:
    """Hash every extent where it was read to (address, extent, message for a digest that does
    not match), largest first, in ``threads`` threads; raise one ChecksumMismatchError naming
    the first problem (by message) and how many more there are."""
    bad: list[str] = []
    lock = threading.Lock()

    def check(item: tuple[int, mf.ExtentEntry, Callable[[int], str]]) -> None:
        at, e, message = item
        got = xxhash.xxh3_64_intdigest(memory_view(at, e.nbytes))
        if got != e.checksum:
            with lock:
                bad.append(message(got))

    with ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="fastpersist-verify") as ex:
        list(ex.map(check, sorted(work, key=lambda w: -w[1].nbytes)))
    if bad:
        bad.sort()
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ChecksumMismatchError(f"{bad[0]}{more}; the checkpoint is corrupt")


# ---------------------------------------------------------------------------------------------
# Verifying


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a checkpoint, as ``fastpersist verify`` reports it."""

    path: str
    what: str  # "object 'replicated' storage '3' bytes 0..4096" or "file"
    offset: int | None
    message: str

    def __str__(self) -> str:
        at = f" at offset {self.offset}" if self.offset is not None else ""
        return f"{self.path}: {self.what}{at}: {self.message}"


def verify(dirs: Sequence[str], manifest: mf.Manifest, chunk: int = 16 << 20,
           backend: FileBackend | None = None,
           progress: Callable[[int], None] | None = None) -> tuple[list[Problem], int]:
    """Run every check :func:`read_object` runs, on every object, and read every byte the
    manifest lists; never stops at the first problem and never raises. Returns the problems
    and the number of bytes verified.

    The checks are load's own (the functions above); what load would build, verify builds on
    the meta device with the weights-only unpickler, so a skeleton that load refuses by default
    is a problem here too. Data is hashed in ``chunk`` pieces, so memory stays bounded;
    ``progress``, if given, is called with the byte count of each piece hashed.
    """
    problems: list[Problem] = []
    where = _manifest_path(dirs)
    _collect(problems, where, "manifest", lambda: check_unverified(dirs, manifest))
    files: dict[int, DirectFile] = {}
    try:
        for i in _needed_files(manifest, list(manifest.objects), sharded=True):
            path = _collect(problems, manifest.files[i].name, "file", lambda i=i: _file_path(dirs, manifest, i))
            file = path and _collect(problems, path, "file", lambda i=i: _open_listed(dirs, manifest, i, "off", backend))
            if file:  # a truncated file stays open: what it still holds is checked, the rest named
                files[i] = file
                _collect(problems, path, "file", lambda i=i, file=file: check_size(file, manifest, i))
        checked = 0
        for name, obj in sorted(manifest.objects.items()):
            checked += _verify_object(problems, dirs, manifest, name, obj, files, chunk, progress)
        for t in manifest.sharded:
            for c in t.chunks:
                checked += _verify_extents(problems, dirs, manifest, files, chunk, c.extents,
                                           f"sharded tensor {t.key!r} chunk at {list(c.offsets)}", progress)
    finally:
        for file in files.values():
            file.close()
    return problems, checked


def _collect(problems: list[Problem], path: str, what: str, step: Any) -> Any:
    """Run one check; a CheckpointError (or an OS error) becomes a Problem."""
    try:
        return step()
    except CheckpointError as e:
        problems.append(Problem(path, what, None, _without_path(str(e), path)))
    except OSError as e:
        problems.append(Problem(path, what, None, f"{e.strerror or e}"))
    return None


def _without_path(message: str, path: str) -> str:
    """``"<path> is truncated: ..."`` -> ``"truncated: ..."`` (the Problem names the path)."""
    if not message.startswith(path):
        return message
    rest = message[len(path):].lstrip(":").strip()
    return rest[3:] if rest.startswith("is ") else rest


def _verify_object(problems: list[Problem], dirs: Sequence[str], manifest: mf.Manifest, name: str,
                   obj: mf.ObjectEntry, files: dict[int, DirectFile], chunk: int,
                   progress: Callable[[int], None] | None = None) -> int:
    sk = obj.skeleton.file
    if sk in files:
        path = _file_path(dirs, manifest, sk)

        def skeleton_check() -> None:
            small = read_skeleton(path, files[sk], manifest, name, True)
            offsets = {f"data/{s.key}": 0 for s in obj.storages}
            skeleton.rebuild(path, skeleton.ArchiveView(small, offsets), None, "meta", True)

        _collect(problems, path, f"object {name!r} skeleton", skeleton_check)
    checked = obj.skeleton.nbytes
    for s in obj.storages:
        checked += _verify_extents(problems, dirs, manifest, files, chunk, s.extents,
                                   f"object {name!r} {storage_name(manifest, name, s.key)}", progress)
    return checked


def _verify_extents(problems: list[Problem], dirs: Sequence[str], manifest: mf.Manifest,
                    files: dict[int, DirectFile], chunk: int, extents: Sequence[mf.ExtentEntry], owner: str,
                    progress: Callable[[int], None] | None = None) -> int:
    checked = 0
    for e in extents:
        if e.file not in files:
            continue  # the file's problem is already reported
        path = _file_path(dirs, manifest, e.file)
        what = f"{owner} bytes {e.start}..{e.start + e.nbytes}"
        if e.offset + e.nbytes > file_size(files[e.file].fd):
            problems.append(Problem(path, what, e.offset, "lies beyond the end of the file"))
            continue
        got = _collect(problems, path, what,
                       lambda e=e, path=path: _hash_range(files[e.file], path, e, chunk, progress))
        if got is None:
            continue
        checked += e.nbytes
        if got != e.checksum:
            problems.append(Problem(path, what, e.offset, f"checksum mismatch (stored {e.checksum:016x}, "
                                                          f"read {got:016x})"))
    return checked


def _hash_range(file: DirectFile, path: str, e: mf.ExtentEntry, chunk: int,
                progress: Callable[[int], None] | None = None) -> int:
    h = xxhash.xxh3_64()
    done = 0
    while done < e.nbytes:
        n = min(chunk, e.nbytes - done)
        h.update(file.read_exact(e.offset + done, n))
        done += n
        if progress is not None:
            progress(n)
    return h.intdigest()
