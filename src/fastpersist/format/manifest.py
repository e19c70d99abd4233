"""The manifest of a sharded checkpoint: its commit record and its map. Pure: no I/O.

A manifest lists the checkpoint's files (root index + plain file name + size) and, for every
object (the replicated state, each rank's own state), its skeleton file and every storage cut
into extents: (file, file offset, storage start, length, xxh3-64 checksum). The format is
specified in docs/FORMAT.md. :func:`parse` is strict: any hole, overlap, size that does not add
up, name that could leave the checkpoint directory, or newer version is an error naming the
manifest, the object, the key and what is wrong.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import xxhash

from fastpersist.errors import ChecksumMismatchError, CorruptCheckpointError, UnsupportedFormatError
from fastpersist.format import jsondoc

FORMAT_NAME = "fastpersist-checkpoint"
FORMAT_VERSION = 2  # 2: the manifest carries a checksum of its own content (version 1 did not)
HASH_NAME = "xxh3-64"
MANIFEST_NAME = "manifest.json"
REPLICATED = "replicated"
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


@dataclass(frozen=True)
class ExtentEntry:
    """``nbytes`` bytes of a storage from byte ``start``, at ``offset`` in file ``file``."""

    file: int
    offset: int
    start: int
    nbytes: int
    checksum: int


@dataclass(frozen=True)
class StorageEntry:
    key: str
    nbytes: int
    extents: tuple[ExtentEntry, ...]


@dataclass(frozen=True)
class ObjectEntry:
    skeleton: ExtentEntry  # the whole skeleton file: start 0, nbytes = its size
    storages: tuple[StorageEntry, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.storages)


@dataclass(frozen=True)
class Manifest:
    step: int
    save_id: str
    created: float
    world_size: int
    roots: int
    files: tuple[FileEntry, ...]
    objects: dict[str, ObjectEntry]
    version: int = FORMAT_VERSION
    user: dict[str, Any] = field(default_factory=dict)
    sequence: int = 0  # commit order among the checkpoints of these roots (0: not recorded)

    @property
    def nbytes(self) -> int:
        return sum(o.nbytes for o in self.objects.values())

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
            "files": [{"root": f.root, "name": f.name, "size": f.size} for f in self.files],
            "objects": {
                name: {
                    "skeleton": _extent_doc(o.skeleton),
                    "storages": [
                        {"key": s.key, "nbytes": s.nbytes, "extents": [_extent_doc(e) for e in s.extents]}
                        for s in o.storages
                    ],
                }
                for name, o in sorted(self.objects.items())
            },
            "user": self.user,
            "sequence": self.sequence,
        }
        body = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        return seal(body) if self.version >= 2 else body


def _extent_doc(e: ExtentEntry) -> dict[str, Any]:
    return {"file": e.file, "offset": e.offset, "start": e.start, "nbytes": e.nbytes, "checksum": f"{e.checksum:016x}"}


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
    files = tuple(_parse_file(rd, i, f, roots) for i, f in enumerate(rd.get(doc, "files", list, "header")))
    seen: set[tuple[int, str]] = set()
    for f in files:
        if (f.root, f.name) in seen:
            raise rd.fail(f"file {f.name!r}", "listed twice")
        seen.add((f.root, f.name))
    objects_doc = rd.get(doc, "objects", dict, "header")
    if REPLICATED not in objects_doc:
        raise rd.fail("objects", f"no {REPLICATED!r} object")
    objects = {name: _parse_object(rd, name, o, files) for name, o in objects_doc.items()}
    _check_file_overlaps(rd, files, objects)
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
    )


def _parse_file(rd: _Reader, i: int, d: Any, roots: int) -> FileEntry:
    where = f"file #{i}"
    name = rd.get(d, "name", str, where)
    if not valid_file_name(name):
        raise rd.fail(where, f"file name {name!r} is not a plain file name inside the checkpoint directory")
    root = rd.count(d, "root", where)
    if root >= roots:
        raise rd.fail(f"file {name!r}", f"root index {root} but the checkpoint has {roots} roots")
    return FileEntry(root, name, rd.count(d, "size", where))


def _parse_extent(rd: _Reader, d: Any, where: str, files: tuple[FileEntry, ...]) -> ExtentEntry:
    f = rd.count(d, "file", where)
    if f >= len(files):
        raise rd.fail(where, f"file index {f} but only {len(files)} files are listed")
    e = ExtentEntry(f, rd.count(d, "offset", where), rd.count(d, "start", where), rd.count(d, "nbytes", where),
                    rd.checksum(d, where))
    if e.offset + e.nbytes > files[f].size:
        raise rd.fail(where, f"bytes {e.offset}..{e.offset + e.nbytes} lie beyond the end of "
                             f"{files[f].name!r} ({files[f].size} bytes)")
    return e


def _parse_object(rd: _Reader, name: str, d: Any, files: tuple[FileEntry, ...]) -> ObjectEntry:
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
    return ObjectEntry(skeleton, tuple(storages))


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


def _check_file_overlaps(rd: _Reader, files: tuple[FileEntry, ...], objects: dict[str, ObjectEntry]) -> None:
    """No two extents (or skeletons) may claim the same bytes of a file."""
    by_file: dict[int, list[tuple[int, int, str]]] = {}
    for name, o in objects.items():
        by_file.setdefault(o.skeleton.file, []).append((o.skeleton.offset, o.skeleton.nbytes, f"object {name!r} skeleton"))
        for s in o.storages:
            for e in s.extents:
                by_file.setdefault(e.file, []).append((e.offset, e.nbytes, f"object {name!r} storage {s.key!r}"))
    for f, spans in by_file.items():
        spans.sort()
        for (a_off, a_n, a_what), (b_off, _, b_what) in zip(spans, spans[1:]):
            if b_off < a_off + a_n:
                raise rd.fail(f"file {files[f].name!r}", f"{b_what} at offset {b_off} overlaps {a_what}")
