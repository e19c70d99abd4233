"""The manifest of a sharded checkpoint: its commit record and its map. Pure: no I/O.

A manifest lists the checkpoint's files (root index + plain file name + size) and, for every
object (the replicated state, each rank's own state), its skeleton file and every storage cut
into extents: (file, file offset, storage start, length, xxh3-64 checksum). The format is
specified in docs/FORMAT.md. :func:`parse` is strict: any hole, overlap, size that does not add
up, name that could leave the checkpoint directory, or newer version is an error naming the
manifest, the object, the key and what is wrong.
"""

from __future__ import annotations

import array
import bisect
import itertools
import json
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from fastpersist.errors import (
    ChecksumMismatchError,
    CheckpointWriteError,
    CorruptCheckpointError,
    UnsupportedFormatError,
)
from fastpersist.format import jsondoc

FORMAT_NAME = "fastpersist-checkpoint"
# 4: copies across nodes (the job's nodes, each file's node, each extent's other copies); written
#    only by a job that spans several nodes (one node writes version 3);
# 3: tensors indexed by key path, sharded tensors (chunks with global offsets), the roots' paths;
# 2: the manifest carries a checksum of its own content (version 1 did not).
FORMAT_VERSION = 4
SINGLE_NODE_VERSION = 3  # what a job on one node writes
MAX_NODES = 1 << 16
HASH_NAME = "xxh3-64"
MANIFEST_NAME = "manifest.json"
REPLICATED = "replicated"
SHARDED = "sharded"  # the name of the data files of sharded tensors (not an object)
# Element sizes of the dtypes a sharded tensor may have (torch's names, without "torch.").
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
MAX_NDIM = 64
MAX_MANIFEST_BYTES = 64 << 20  # a manifest larger than this is refused before it is read

# A data file name: no directory part, no "..", not hidden, ASCII only. Checked on write and on
# read, always with fullmatch (``$`` would accept a trailing newline, ``\d`` non-ASCII digits).
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}", re.ASCII)
_OBJECT_NAME = re.compile(r"replicated|rank-[0-9]{5}", re.ASCII)
_CHECKSUM = re.compile(r"[0-9a-f]{16}", re.ASCII)
# The manifest's own checksum: the last field of the document, over every byte before it (with
# the document closed where the field starts). See docs/FORMAT.md.
_SELF_FIELD = "manifest_checksum"
_SELF_TAIL = re.compile(rb',"manifest_checksum":"([0-9a-f]{16})"\}\Z')
_MAX_CREATED = 253402214400  # seconds since 1970: 9999-12-31, the last day datetime can show


def rank_object(rank: int) -> str:
    """The object name of ``rank``'s own state."""
    return f"rank-{rank:05d}"


def key_name(path: tuple[str | int, ...]) -> str:
    """The dotted name of a key path: ``("optim", "state", 0, "exp_avg")`` -> ``optim.state.0.exp_avg``."""
    return ".".join(map(str, path))


def valid_file_name(name: str) -> bool:
    return bool(_FILE_NAME.fullmatch(name)) and ".." not in name


def seal(body: bytes) -> bytes:
    """The manifest with its own checksum appended as its last field (``body`` is a compact JSON
    object)."""
    return body[:-1] + b',"%s":"%016x"}' % (_SELF_FIELD.encode(), xxhash.xxh3_64_intdigest(body))


def _check_seal(path: str, raw: bytes, doc: dict[str, Any], version: int) -> None:
    """The manifest's own checksum must match (required from version 2)."""
    m = _SELF_TAIL.search(raw)
    if m is None:
        if version >= 2 or _SELF_FIELD in doc:
            raise CorruptCheckpointError(f"{path}: the manifest's own checksum ({_SELF_FIELD!r}, its last "
                                         "field) is missing or damaged; the manifest is damaged or was edited")
        return
    body = raw[: m.start()] + b"}"
    got = xxhash.xxh3_64_intdigest(body)
    if got != int(m.group(1), 16) or doc.get(_SELF_FIELD) != m.group(1).decode():
        raise ChecksumMismatchError(f"{path}: the manifest fails its own checksum (stored {m.group(1).decode()}, "
                                    f"computed {got:016x}); the manifest is damaged or was edited")


@dataclass(frozen=True)
class FileEntry:
    root: int
    name: str
    size: int
    node: int = 0  # version 4: the index (in Manifest.nodes) of the node whose disks hold it


@dataclass(frozen=True)
class ExtentEntry:
    """``nbytes`` bytes of a storage from byte ``start``, at ``offset`` in file ``file``."""

    file: int
    offset: int
    start: int
    nbytes: int
    checksum: int
    # version 4: the same bytes at (file, offset) in files on other nodes, one per node
    copies: tuple[tuple[int, int], ...] = ()

    def locations(self) -> tuple[tuple[int, int], ...]:
        """Every (file, offset) holding these bytes, the first one first."""
        return ((self.file, self.offset), *self.copies)


@dataclass(frozen=True)
class StorageEntry:
    key: str
    nbytes: int
    extents: tuple[ExtentEntry, ...]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of an object, by its key path: a view (dtype, shape, stride, element offset)
    of one of the object's storages."""

    path: tuple[str | int, ...]
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: str
    offset: int

    @property
    def key(self) -> str:
        return key_name(self.path)

    @property
    def nbytes(self) -> int:
        return _volume(self.shape) * DTYPE_SIZES.get(self.dtype, 1)


@dataclass(frozen=True)
class ObjectEntry:
    skeleton: ExtentEntry  # the whole skeleton file: start 0, nbytes = its size
    storages: tuple[StorageEntry, ...]
    tensors: tuple[TensorEntry, ...] = ()  # version 3: every tensor reachable through dicts/lists

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


@dataclass(frozen=True)
class ChunkEntry:
    """One saved part of a sharded tensor: the box ``[offsets, offsets + sizes)`` of the global
    tensor, its elements in row-major order, cut into extents (``start`` counts from the
    chunk's first byte)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    extents: tuple[ExtentEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.extents)


@dataclass(frozen=True)
class ShardedEntry:
    """A sharded tensor (a DTensor at save time): its global dtype and shape and the chunks
    that tile it exactly once."""

    path: tuple[str | int, ...]
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkEntry, ...]

    @property
    def key(self) -> str:
        return key_name(self.path)

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return _volume(self.shape) * self.itemsize


def _volume(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class Manifest:
    step: int
    save_id: str
    created: float
    world_size: int
    roots: int
    files: tuple[FileEntry, ...]
    objects: dict[str, ObjectEntry]
    version: int = SINGLE_NODE_VERSION  # 4 only with nodes (see FORMAT_VERSION)
    user: dict[str, Any] = field(default_factory=dict)
    sequence: int = 0  # commit order among the checkpoints of these roots (0: not recorded)
    sharded: tuple[ShardedEntry, ...] = ()  # version 3
    root_paths: tuple[str, ...] = ()  # version 3: each root's absolute path at save time
    nodes: tuple[str, ...] = ()  # version 4: the ids of the nodes the job ran on at save time
    node: int = 0  # version 4: the node whose roots this copy of the manifest was written to

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.objects.values()) + sum(t.nbytes for t in self.sharded)

    def sharded_by_key(self) -> dict[str, ShardedEntry]:
        return {t.key: t for t in self.sharded}

    def to_json(self) -> bytes:
        doc = {
            "format": FORMAT_NAME,
            "version": self.version,
            "hash": HASH_NAME,
            "step": self.step,
            "save_id": self.save_id,
            "created": self.created,
            "world_size": self.world_size,
            "roots": self.roots,
            "files": [{"root": f.root, "name": f.name, "size": f.size, **({"node": f.node} if self.version >= 4 else {})}
                      for f in self.files],
            "objects": {name: self._object_doc(o) for name, o in sorted(self.objects.items())},
            "user": self.user,
            "sequence": self.sequence,
        }
        if self.version >= 3:
            doc["sharded"] = [
                {"path": list(t.path), "dtype": t.dtype, "shape": list(t.shape),
                 "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes),
                             "extents": [_extent_doc(e) for e in c.extents]} for c in t.chunks]}
                for t in self.sharded
            ]
            doc["root_paths"] = list(self.root_paths)
        if self.version >= 4:
            doc["nodes"] = list(self.nodes)
            doc["node"] = self.node
        body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        out = seal(body) if self.version >= 2 else body
        if len(out) > MAX_MANIFEST_BYTES:  # a reader would refuse it: never commit one
            raise CheckpointWriteError(
                f"checkpoint step {self.step}: its manifest would be {len(out)} bytes, and readers accept at most "
                f"{MAX_MANIFEST_BYTES}: the state has too many tensors or extents "
                f"({sum(len(s.extents) for o in self.objects.values() for s in o.storages)} extents); nothing was "
                "committed")
        return out


    def _object_doc(self, o: ObjectEntry) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "skeleton": _extent_doc(o.skeleton),
            "storages": [{"key": s.key, "nbytes": s.nbytes, "extents": [_extent_doc(e) for e in s.extents]}
                         for s in o.storages],
        }
        if self.version >= 3:
            doc["tensors"] = [{"path": list(t.path), "dtype": t.dtype, "shape": list(t.shape),
                               "stride": list(t.stride), "storage": t.storage, "offset": t.offset}
                              for t in o.tensors]
        return doc


def _extent_doc(e: ExtentEntry) -> dict[str, Any]:
    doc: dict[str, Any] = {"file": e.file, "offset": e.offset, "start": e.start, "nbytes": e.nbytes,
                           "checksum": f"{e.checksum:016x}"}
    if e.copies:
        doc["copies"] = [list(c) for c in e.copies]
    return doc


class _Reader:
    """Strict field access with errors naming the manifest and the place."""

    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, where: str, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.path}: {where}: {what}; the manifest is damaged or was edited")

    def get(self, d: Any, key: str, kind: type, where: str) -> Any:
        if not isinstance(d, dict) or key not in d:
            raise self.fail(where, f"missing field {key!r}")
        v = d[key]
        if kind is int and (not isinstance(v, int) or isinstance(v, bool)):
            raise self.fail(where, f"field {key!r} must be an integer, got {v!r}")
        if kind is not int and not isinstance(v, kind):
            raise self.fail(where, f"field {key!r} must be a {kind.__name__}, got {type(v).__name__}")
        return v

    def count(self, d: Any, key: str, where: str) -> int:
        v = self.get(d, key, int, where)
        if v < 0:
            raise self.fail(where, f"field {key!r} is negative ({v})")
        return int(v)

    def checksum(self, d: Any, where: str) -> int:
        v = self.get(d, "checksum", str, where)
        if not _CHECKSUM.fullmatch(v):
            raise self.fail(where, f"checksum {v!r} is not 16 hex digits")
        return int(v, 16)


def parse(path: str, raw: bytes) -> Manifest:
    """Read and validate a manifest; ``path`` is only used in messages."""
    rd = _Reader(path)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path} is {len(raw)} bytes, more than a manifest may be "
                                     f"({MAX_MANIFEST_BYTES})")
    doc = jsondoc.loads(path, raw, "manifest")
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{path} is not a fastpersist manifest (no format {FORMAT_NAME!r})")
    version = rd.get(doc, "version", int, "header")
    if version < 1:
        raise rd.fail("header", f"version {version} does not exist")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{path} was written in {FORMAT_NAME} format version {version}; this fastpersist reads "
            f"versions up to {FORMAT_VERSION}: upgrade fastpersist to load it"
        )
    if rd.get(doc, "hash", str, "header") != HASH_NAME:
        raise rd.fail("header", f"unknown hash {doc['hash']!r}")
    roots = rd.count(doc, "roots", "header")
    nodes: tuple[str, ...] = ()
    node = 0
    if version >= 4:
        nodes = tuple(_parse_node_id(rd, i, n) for i, n in enumerate(rd.get(doc, "nodes", list, "header")))
        if not 1 <= len(nodes) <= MAX_NODES or len(set(nodes)) != len(nodes):
            raise rd.fail("header", f"'nodes' must list 1 to {MAX_NODES} distinct node ids, got {len(nodes)}")
        node = rd.count(doc, "node", "header")
        if node >= len(nodes):
            raise rd.fail("header", f"node index {node} but the checkpoint has {len(nodes)} nodes")
    files = tuple(_parse_file(rd, i, f, roots, len(nodes) if version >= 4 else 0)
                  for i, f in enumerate(rd.get(doc, "files", list, "header")))
    seen: set[tuple[int, str]] = set()
    for f in files:
        if (f.root, f.name) in seen:
            raise rd.fail(f"file {f.name!r}", "listed twice")
        seen.add((f.root, f.name))
    objects_doc = rd.get(doc, "objects", dict, "header")
    if REPLICATED not in objects_doc:
        raise rd.fail("objects", f"no {REPLICATED!r} object")
    objects = {name: _parse_object(rd, name, o, files, version) for name, o in objects_doc.items()}
    sharded: tuple[ShardedEntry, ...] = ()
    root_paths: tuple[str, ...] = ()
    if version >= 3:
        sharded = tuple(_parse_sharded(rd, i, t, files) for i, t in enumerate(rd.get(doc, "sharded", list, "header")))
        _check_unique_keys(rd, objects.get(REPLICATED), sharded)
        root_paths = tuple(_parse_root_path(rd, i, p) for i, p in enumerate(rd.get(doc, "root_paths", list, "header")))
        if len(root_paths) not in (0, roots):
            raise rd.fail("header", f"{len(root_paths)} root paths for {roots} roots")
    _check_file_overlaps(rd, files, objects, sharded)
    user = doc.get("user", {})
    if not isinstance(user, dict):
        raise rd.fail("header", "field 'user' must be an object")
    created = doc.get("created", 0.0)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < _MAX_CREATED:
        raise rd.fail("header", f"field 'created' must be a time in seconds since 1970, got {created!r}")
    sequence = rd.count(doc, "sequence", "header") if "sequence" in doc else 0
    _check_seal(path, raw, doc, version)  # last: a damaged field is named by the checks above first
    return Manifest(
        step=rd.count(doc, "step", "header"),
        save_id=rd.get(doc, "save_id", str, "header"),
        created=float(created),
        world_size=rd.count(doc, "world_size", "header"),
        roots=roots,
        files=files,
        objects=objects,
        version=version,
        user=user,
        sequence=sequence,
        sharded=sharded,
        root_paths=root_paths,
        nodes=nodes,
        node=node,
    )


def _parse_node_id(rd: _Reader, i: int, n: Any) -> str:
    if not isinstance(n, str) or not valid_node_id(n):
        raise rd.fail("header", f"node id #{i} must be 1 to 200 printable characters, got {n!r}")
    return n


def valid_node_id(n: str) -> bool:
    return 0 < len(n) <= 200 and n.isprintable()


def _parse_file(rd: _Reader, i: int, d: Any, roots: int, nodes: int) -> FileEntry:
    where = f"file #{i}"
    name = rd.get(d, "name", str, where)
    if not valid_file_name(name):
        raise rd.fail(where, f"file name {name!r} is not a plain file name inside the checkpoint directory")
    root = rd.count(d, "root", where)
    if root >= roots:
        raise rd.fail(f"file {name!r}", f"root index {root} but the checkpoint has {roots} roots")
    node = 0
    if nodes:
        node = rd.count(d, "node", f"file {name!r}")
        if node >= nodes:
            raise rd.fail(f"file {name!r}", f"node index {node} but the checkpoint has {nodes} nodes")
    return FileEntry(root, name, rd.count(d, "size", where), node)


def _parse_extent(rd: _Reader, d: Any, where: str, files: tuple[FileEntry, ...]) -> ExtentEntry:
    f = rd.count(d, "file", where)
    if f >= len(files):
        raise rd.fail(where, f"file index {f} but only {len(files)} files are listed")
    e = ExtentEntry(f, rd.count(d, "offset", where), rd.count(d, "start", where), rd.count(d, "nbytes", where),
                    rd.checksum(d, where))
    if e.offset + e.nbytes > files[f].size:
        raise rd.fail(where, f"bytes {e.offset}..{e.offset + e.nbytes} lie beyond the end of "
                             f"{files[f].name!r} ({files[f].size} bytes)")
    if "copies" in d:
        copies = _parse_copies(rd, d["copies"], where, files, e)
        e = ExtentEntry(e.file, e.offset, e.start, e.nbytes, e.checksum, copies)
    return e


def _parse_copies(rd: _Reader, raw: Any, where: str, files: tuple[FileEntry, ...],
                  e: ExtentEntry) -> tuple[tuple[int, int], ...]:
    """An extent's other copies: (file, offset) pairs inside their files, each on a node of its
    own (a second copy on the same node would not survive that node)."""
    if not isinstance(raw, list) or len(raw) > MAX_NODES:
        raise rd.fail(where, "field 'copies' must be a list of [file, offset] pairs")
    nodes = {files[e.file].node}
    out = []
    for c in raw:
        if (not isinstance(c, list) or len(c) != 2
                or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in c)):
            raise rd.fail(where, f"a copy must be a [file, offset] pair of non-negative integers, got {c!r}")
        f, off = c
        if f >= len(files):
            raise rd.fail(where, f"a copy's file index {f} but only {len(files)} files are listed")
        if off + e.nbytes > files[f].size:
            raise rd.fail(where, f"the copy at bytes {off}..{off + e.nbytes} lies beyond the end of "
                                 f"{files[f].name!r} ({files[f].size} bytes)")
        if files[f].node in nodes:
            raise rd.fail(where, f"two copies on node #{files[f].node}")
        nodes.add(files[f].node)
        out.append((f, off))
    return tuple(out)


def _parse_object(rd: _Reader, name: str, d: Any, files: tuple[FileEntry, ...], version: int) -> ObjectEntry:
    if not _OBJECT_NAME.fullmatch(name):
        raise rd.fail(f"object {name!r}", "unknown object name")
    skeleton = _parse_extent(rd, rd.get(d, "skeleton", dict, f"object {name!r}"), f"object {name!r} skeleton", files)
    storages = []
    keys: set[str] = set()
    for i, s in enumerate(rd.get(d, "storages", list, f"object {name!r}")):
        key = rd.get(s, "key", str, f"object {name!r} storage #{i}")
        where = f"object {name!r} storage {key!r}"
        if key in keys:
            raise rd.fail(where, "listed twice")
        if key != str(i):  # the writer lists storages in pickler order, keyed 0, 1, ...
            raise rd.fail(where, f"listed at position {i}: storage keys must be 0, 1, ... in order (swapped "
                                 "or renamed keys would bind a tensor to another tensor's bytes)")
        keys.add(key)
        nbytes = rd.count(s, "nbytes", where)
        extents = tuple(_parse_extent(rd, e, f"{where} extent #{j}", files)
                        for j, e in enumerate(rd.get(s, "extents", list, where)))
        _check_coverage(rd, where, nbytes, extents)
        storages.append(StorageEntry(key, nbytes, extents))
    tensors: tuple[TensorEntry, ...] = ()
    if version >= 3:
        sizes = {s.key: s.nbytes for s in storages}
        tensors = tuple(_parse_tensor(rd, name, i, t, sizes)
                        for i, t in enumerate(rd.get(d, "tensors", list, f"object {name!r}")))
        seen: set[tuple[str | int, ...]] = set()
        for t in tensors:
            if t.path in seen:
                raise rd.fail(f"object {name!r} tensor {t.key!r}", "listed twice")
            seen.add(t.path)
    return ObjectEntry(skeleton, tuple(storages), tensors)


def _parse_path(rd: _Reader, d: Any, where: str) -> tuple[str | int, ...]:
    path = rd.get(d, "path", list, where)
    if not path or len(path) > MAX_NDIM * 4:
        raise rd.fail(where, f"a key path has 1 to {MAX_NDIM * 4} parts, got {len(path)}")
    for part in path:
        if isinstance(part, bool) or not isinstance(part, (str, int)):
            raise rd.fail(where, f"key path parts are strings or integers, got {part!r}")
    return tuple(path)


def _parse_dims(rd: _Reader, d: Any, key: str, where: str) -> tuple[int, ...]:
    dims = rd.get(d, key, list, where)
    if len(dims) > MAX_NDIM:
        raise rd.fail(where, f"{key!r} has {len(dims)} dimensions (at most {MAX_NDIM})")
    for n in dims:
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise rd.fail(where, f"{key!r} must hold non-negative integers, got {n!r}")
    return tuple(dims)


def _parse_dtype(rd: _Reader, d: Any, where: str) -> str:
    dtype = rd.get(d, "dtype", str, where)
    if dtype not in DTYPE_SIZES:
        raise rd.fail(where, f"unknown dtype {dtype!r}")
    return dtype


def _parse_tensor(rd: _Reader, name: str, i: int, d: Any, storages: dict[str, int]) -> TensorEntry:
    where = f"object {name!r} tensor #{i}"
    path = _parse_path(rd, d, where)
    where = f"object {name!r} tensor {key_name(path)!r}"
    dtype = _parse_dtype(rd, d, where)
    shape, stride = _parse_dims(rd, d, "shape", where), _parse_dims(rd, d, "stride", where)
    if len(stride) != len(shape):
        raise rd.fail(where, f"shape {list(shape)} and stride {list(stride)} differ in length")
    storage = rd.get(d, "storage", str, where)
    if storage not in storages:
        raise rd.fail(where, f"storage {storage!r} is not listed")
    offset = rd.count(d, "offset", where)
    if _volume(shape):
        last = offset + sum((n - 1) * st for n, st in zip(shape, stride))
        if (last + 1) * DTYPE_SIZES[dtype] > storages[storage]:
            raise rd.fail(where, f"the view (offset {offset}, shape {list(shape)}, stride {list(stride)}) lies "
                                 f"beyond storage {storage!r} ({storages[storage]} bytes)")
    return TensorEntry(path, dtype, shape, stride, storage, offset)


def _parse_sharded(rd: _Reader, i: int, d: Any, files: tuple[FileEntry, ...]) -> ShardedEntry:
    where = f"sharded tensor #{i}"
    path = _parse_path(rd, d, where)
    where = f"sharded tensor {key_name(path)!r}"
    dtype = _parse_dtype(rd, d, where)
    shape = _parse_dims(rd, d, "shape", where)
    chunks = []
    for j, c in enumerate(rd.get(d, "chunks", list, where)):
        at = f"{where} chunk #{j}"
        offsets, sizes = _parse_dims(rd, c, "offsets", at), _parse_dims(rd, c, "sizes", at)
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise rd.fail(at, f"offsets {list(offsets)} and sizes {list(sizes)} must have the tensor's "
                              f"{len(shape)} dimensions")
        if any(o + n > g for o, n, g in zip(offsets, sizes, shape)):
            raise rd.fail(at, f"the chunk at {list(offsets)} of size {list(sizes)} exceeds the tensor's global "
                              f"shape {list(shape)}")
        if not _volume(sizes):
            raise rd.fail(at, "the chunk is empty")
        extents = tuple(_parse_extent(rd, e, f"{at} extent #{k}", files)
                        for k, e in enumerate(rd.get(c, "extents", list, at)))
        _check_coverage(rd, at, _volume(sizes) * DTYPE_SIZES[dtype], extents)
        chunks.append(ChunkEntry(offsets, sizes, extents))
    _check_tiling(rd, where, shape, chunks)
    return ShardedEntry(path, dtype, shape, tuple(chunks))


def _check_tiling(rd: _Reader, where: str, shape: tuple[int, ...], chunks: list[ChunkEntry]) -> None:
    problem = tiling_problem(shape, [(c.offsets, c.sizes) for c in chunks])
    if problem:
        raise rd.fail(where, problem)


# The chunks of one tensor, cut along every chunk boundary, form a grid of at most this many
# cells (a DTensor layout gives about one cell per chunk).
MAX_TILING_CELLS = 1 << 20


def tiling_problem(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """What keeps ``boxes`` (offsets, sizes) from tiling a tensor of ``shape`` exactly: two that
    overlap, or volumes that do not add up (with no overlap: a hole).

    The boxes are placed on the grid their boundaries cut the tensor into; each grid cell may be
    covered once. The work is the number of cells, bounded by :data:`MAX_TILING_CELLS`.
    """
    total = sum(_volume(n) for _, n in boxes)
    if not shape:
        if len(boxes) > 1:
            return f"a 0-dimensional tensor has {len(boxes)} chunks"
    elif boxes:
        cuts = [sorted({0, g} | {o[d] for o, _ in boxes} | {o[d] + n[d] for o, n in boxes})
                for d, g in enumerate(shape)]
        cells = 1
        for c in cuts:
            cells *= len(c) - 1
            if cells > MAX_TILING_CELLS:
                return (f"its {len(boxes)} chunks cut it into more than {MAX_TILING_CELLS} cells; a checkpoint's "
                        "chunks form a grid")
        strides = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * (len(cuts[d + 1]) - 1)
        owner = array.array("i", [-1]) * cells
        for k, (o, n) in enumerate(boxes):
            ranges = [range(bisect.bisect_left(c, o[d]), bisect.bisect_left(c, o[d] + n[d])) for d, c in enumerate(cuts)]
            for index in itertools.product(*ranges):
                cell = sum(i * st for i, st in zip(index, strides))
                if owner[cell] >= 0:
                    return f"the chunks at {list(boxes[owner[cell]][0])} and {list(o)} overlap"
                owner[cell] = k
    if total != _volume(shape):
        return (f"the chunks hold {total} elements but the tensor has {_volume(shape)}: a part of the tensor "
                "is missing")
    return None


def _check_unique_keys(rd: _Reader, replicated: ObjectEntry | None, sharded: tuple[ShardedEntry, ...]) -> None:
    seen = {t.path for t in replicated.tensors} if replicated is not None else set()
    for t in sharded:
        if t.path in seen:
            raise rd.fail(f"sharded tensor {t.key!r}", "its key is listed twice")
        seen.add(t.path)


def _parse_root_path(rd: _Reader, i: int, p: Any) -> str:
    if not isinstance(p, str) or not p.startswith("/") or "\0" in p or len(p) > 4096:
        raise rd.fail("header", f"root path #{i} must be an absolute path, got {p!r}")
    return p


def _check_coverage(rd: _Reader, where: str, nbytes: int, extents: tuple[ExtentEntry, ...]) -> None:
    """Extents, in order, must cover [0, nbytes) exactly once."""
    pos = 0
    for e in extents:
        if e.nbytes == 0:
            raise rd.fail(where, f"empty extent at byte {e.start}")
        if e.start > pos:
            raise rd.fail(where, f"hole: bytes {pos}..{e.start} are in no extent")
        if e.start < pos:
            raise rd.fail(where, f"overlap: the extent at byte {e.start} starts inside the previous one (ends at {pos})")
        pos = e.start + e.nbytes
    if pos != nbytes:
        raise rd.fail(where, f"extents cover {pos} bytes but the storage has {nbytes}")


def _check_file_overlaps(rd: _Reader, files: tuple[FileEntry, ...], objects: dict[str, ObjectEntry],
                         sharded: tuple[ShardedEntry, ...] = ()) -> None:
    """No two extents (or skeletons) may claim the same bytes of a file."""
    by_file: dict[int, list[tuple[int, int, str]]] = {}

    def add(e: ExtentEntry, what: str) -> None:
        for f, off in e.locations():
            by_file.setdefault(f, []).append((off, e.nbytes, what))

    for t in sharded:
        for c in t.chunks:
            for e in c.extents:
                add(e, f"sharded tensor {t.key!r}")
    for name, o in objects.items():
        add(o.skeleton, f"object {name!r} skeleton")
        for s in o.storages:
            for e in s.extents:
                add(e, f"object {name!r} storage {s.key!r}")
    for f, spans in by_file.items():
        spans.sort()
        for (a_off, a_n, a_what), (b_off, _, b_what) in zip(spans, spans[1:]):
            if b_off < a_off + a_n:
                raise rd.fail(f"file {files[f].name!r}", f"{b_what} at offset {b_off} overlaps {a_what}")
