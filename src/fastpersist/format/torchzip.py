"""The single-file layout: torch's own zip archive, with every storage record 4 KiB-aligned.

fastpersist lets torch lay out the archive (so plain ``torch.load`` reads the result) but keeps
the storage bytes for its own write engine. :func:`layout` runs torch's serializer against a
recording sink: every byte torch writes (zip headers, the pickle, small records) is captured in
memory, and each storage record is only *reserved* (``write_record_metadata``), which tells us
the record's file offset. No storage byte is copied here.

After the storage records, fastpersist adds one record of its own, ``.fastpersist``, holding a
JSON document with the xxh3-64 digest of every other record. torch ignores it; ``load`` uses it
to verify what it read. The record has a fixed size known before the digests, so it is reserved
with the others and filled last. Its format is specified in docs/FORMAT.md.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from fastpersist import _torch
from fastpersist.errors import CorruptCheckpointError, UnsaveableObjectError, UnsupportedFormatError
from fastpersist.format import jsondoc, zipdir

STORAGE_ALIGNMENT = 4096
CHECKSUM_RECORD = ".fastpersist"
FORMAT_NAME = "fastpersist-single-file"
FORMAT_VERSION = 1
HASH_NAME = "xxh3-64"
_DIGEST_PLACEHOLDER = "0" * 16
_DIGEST = re.compile(r"[0-9a-f]{16}", re.ASCII)
MAX_CHECKSUM_RECORD_BYTES = 64 << 20
MAX_SMALL_RECORD_BYTES = 1 << 20  # any other record that is not a storage or data.pkl
# Records torch writes after ``.fastpersist``: not covered by it, and not needed to load.
TRAILING_RECORDS = frozenset({"version", ".data/version", ".data/serialization_id"})


@dataclass
class StorageRecord:
    """A storage of the object and where its bytes go in the file."""

    name: str  # record name, "data/<key>"
    storage: torch.UntypedStorage
    offset: int
    nbytes: int


@dataclass
class Layout:
    """Everything needed to write one archive.

    ``chunks`` are the bytes torch wrote (offset, bytes) before ``body_end``; ``tail`` is every
    byte from ``body_end`` to the end of the file, with the checksum record still blank at
    ``checksum_offset`` (relative to the file).
    """

    chunks: list[tuple[int, bytes]]
    storages: list[StorageRecord]
    small_digests: dict[str, int]
    body_end: int
    tail: bytearray
    checksum_offset: int
    checksum_names: list[str] = field(default_factory=list)

    @property
    def file_size(self) -> int:
        return self.body_end + len(self.tail)

    def finish_tail(self, digests: dict[str, int]) -> bytes:
        """The tail with the checksum record filled in."""
        doc = _checksum_document({n: digests[n] for n in self.checksum_names})
        rel = self.checksum_offset - self.body_end
        out = bytearray(self.tail)
        out[rel : rel + len(doc)] = doc
        return bytes(out)


class _Sink:
    """A file-like object that keeps what is written and remembers the position."""

    def __init__(self) -> None:
        self.pos = 0
        self.chunks: list[tuple[int, bytes]] = []
        self.skipped_from = -1  # where the last seek started: the start of a reserved record

    def write(self, data: object) -> int:
        b = bytes(memoryview(data))  # type: ignore[arg-type]
        if b:
            self.chunks.append((self.pos, b))
        self.pos += len(b)
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.skipped_from = self.pos
        if whence == 0:
            self.pos = offset
        elif whence == 1:
            self.pos += offset
        else:
            raise OSError("fastpersist's layout sink only seeks from the start or the current position")
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


class _Recorder:
    """Stands in for torch's zip writer inside ``torch.serialization._save``.

    Storage records are reserved instead of written; ``.storage_alignment`` is recorded as the
    alignment actually used, so torch's offset arithmetic on load stays right.
    """

    def __init__(self, real: Any, sink: _Sink) -> None:  # real: torch._C.PyTorchFileWriter
        self._real = real
        self._sink = sink
        self.storages: list[StorageRecord] = []
        self.small_digests: dict[str, int] = {}

    def write_record(self, name: str, data: object, nbytes: int) -> None:
        if isinstance(data, (torch.UntypedStorage, torch.TypedStorage)):
            storage = data if isinstance(data, torch.UntypedStorage) else data._untyped_storage
            self._sink.skipped_from = -1
            self._real.write_record_metadata(name, nbytes)
            if nbytes:  # torch skips the record's bytes with one seek from their start
                self.storages.append(StorageRecord(name, storage, self._sink.skipped_from, nbytes))
            return
        if name == ".storage_alignment":
            data = str(STORAGE_ALIGNMENT)
            nbytes = len(data)
        raw = data.encode() if isinstance(data, str) else bytes(data)  # type: ignore[call-overload]
        self.small_digests[name] = xxhash.xxh3_64_intdigest(raw)
        self._real.write_record(name, data, nbytes)

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def layout(obj: object, pickle_protocol: int = 2) -> Layout:
    """Lay out ``obj`` as a torch zip archive with 4 KiB-aligned storage records.

    Raises :class:`UnsaveableObjectError` when torch's serializer rejects the object.
    """
    sink = _Sink()
    real = _torch.file_writer(sink, False, STORAGE_ALIGNMENT)  # no CRC32: xxh3 instead
    rec = _Recorder(real, sink)
    try:
        _torch.save_records(obj, rec, pickle, pickle_protocol)
    except Exception as e:
        raise UnsaveableObjectError(f"the object cannot be serialized: {type(e).__name__}: {e}") from e
    body_end = sink.pos
    names = sorted(rec.small_digests) + [s.name for s in rec.storages]
    size = len(_checksum_document({n: 0 for n in names}))
    real.write_record_metadata(CHECKSUM_RECORD, size)
    checksum_offset = sink.skipped_from
    real.write_end_of_file()
    chunks = [c for c in sink.chunks if c[0] < body_end]
    tail = bytearray(sink.pos - body_end)
    for off, b in sink.chunks:
        if off >= body_end:
            tail[off - body_end : off - body_end + len(b)] = b
    return Layout(chunks, rec.storages, rec.small_digests, body_end, tail, checksum_offset, names)


def _checksum_document(digests: dict[str, int]) -> bytes:
    doc = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "hash": HASH_NAME,
        "records": {n: f"{d:016x}" for n, d in digests.items()},
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def byte_view(storage: torch.UntypedStorage) -> torch.Tensor:
    """A 1-D uint8 tensor over all bytes of ``storage`` (no copy)."""
    t = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return t.set_(storage, 0, (storage.nbytes(),), (1,))


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class Record:
    name: str  # without the archive prefix, e.g. "data/0"
    offset: int  # of the record's bytes in the file
    nbytes: int
    crc32: int = 0  # the zip directory's CRC-32 (0 in fastpersist files)


def _fd_reader(path: str, fd: int) -> zipdir.ReadAt:
    def read_at(offset: int, nbytes: int) -> bytes:
        out = bytearray()
        while len(out) < nbytes:
            got = os.pread(fd, nbytes - len(out), offset + len(out))
            if not got:  # a read that cannot advance is truncation, never retried
                raise CorruptCheckpointError(f"{path} is truncated: {nbytes} bytes expected at offset {offset}")
            out += got
        return bytes(out)

    return read_at


def read_directory(path: str, source: int | zipdir.ReadAt, file_size: int) -> dict[str, Record]:
    """The records of the torch archive at ``path``, with the offsets of their bytes.

    ``source`` is the open file's descriptor, or a ``read_at(offset, nbytes)`` function.

    The directory is read strictly (:mod:`fastpersist.format.zipdir`): stored records only,
    inside the file, none overlapping or repeated. Every name must sit under one top-level
    folder, as torch writes them. Raises :class:`CorruptCheckpointError` naming the file.
    """
    read_at = _fd_reader(path, source) if isinstance(source, int) else source
    found = zipdir.read_directory(path, read_at, file_size)
    records = {r.name.split("/", 1)[-1]: Record(r.name.split("/", 1)[-1], r.offset, r.nbytes, r.crc32) for r in found}
    if "data.pkl" not in records:
        raise CorruptCheckpointError(
            f"{path} is a zip archive but not a torch checkpoint: it has no data.pkl record"
        )
    prefixes = {r.name.split("/", 1)[0] for r in found}
    if len(prefixes) > 1 or any("/" not in r.name for r in found) or len(records) != len(found):
        raise CorruptCheckpointError(f"{path} is not a torch archive: its records are not all in one folder "
                                     f"({sorted(prefixes)[:3]})")
    return records


def parse_checksums(path: str, raw: bytes) -> dict[str, int]:
    """The digests recorded in a ``.fastpersist`` record (strict: every field checked)."""
    doc = jsondoc.loads(path, raw, f"{CHECKSUM_RECORD} record")

    def damaged(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: the {CHECKSUM_RECORD} record is damaged ({what})")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise damaged("not a fastpersist checksum record")
    version = doc.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise damaged(f"version {str(version)[:40]} is not a version number")
    if version > FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"{path} was written in {FORMAT_NAME} format version {version}; this fastpersist "
            f"reads versions up to {FORMAT_VERSION}: upgrade fastpersist to load it"
        )
    if doc.get("hash") != HASH_NAME:
        raise damaged(f"unknown hash {str(doc.get('hash'))[:40]!r}")
    records = doc.get("records")
    if not isinstance(records, dict) or not records:
        raise damaged("it lists no records")
    if not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in records.values()):
        raise damaged("a digest is not 16 hex digits")
    return {n: int(d, 16) for n, d in records.items()}
