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
import struct
import zipfile
from dataclasses import dataclass, field

import torch
import xxhash

from fastpersist.errors import CorruptCheckpointError, UnsaveableObjectError, UnsupportedFormatError

STORAGE_ALIGNMENT = 4096
CHECKSUM_RECORD = ".fastpersist"
FORMAT_NAME = "fastpersist-single-file"
FORMAT_VERSION = 1
HASH_NAME = "xxh3-64"
_DIGEST_PLACEHOLDER = "0" * 16


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

    def __init__(self, real: torch._C.PyTorchFileWriter, sink: _Sink) -> None:
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
    real = torch._C.PyTorchFileWriter(sink, False, STORAGE_ALIGNMENT)  # no CRC32: xxh3 instead
    rec = _Recorder(real, sink)
    try:
        torch.serialization._save(obj, rec, pickle, pickle_protocol, False)
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


_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"


def read_directory(path: str, fd: int, file_size: int) -> dict[str, Record]:
    """The records of the archive at ``path``, with the offsets of their bytes.

    Raises :class:`CorruptCheckpointError` naming the file when it is not a zip archive, is
    truncated, or has a record that does not fit in the file.
    """
    try:
        with open(fd, "rb", closefd=False) as f, zipfile.ZipFile(f) as z:
            infos = z.infolist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        raise CorruptCheckpointError(
            f"{path} is not a readable checkpoint: no valid zip directory ({e}); the file is "
            "truncated, damaged, or was not written by fastpersist.save / torch.save"
        ) from e
    records: dict[str, Record] = {}
    for info in infos:
        name = info.filename.split("/", 1)[1] if "/" in info.filename else info.filename
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(f"{path}: record {name!r} is compressed; torch archives never are")
        header = os.pread(fd, _LOCAL_HEADER.size, info.header_offset)
        if len(header) < _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
            raise CorruptCheckpointError(
                f"{path}: record {name!r} has no valid local header at offset {info.header_offset}"
            )
        fields = _LOCAL_HEADER.unpack(header)
        offset = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
        if offset + info.file_size > file_size:
            raise CorruptCheckpointError(
                f"{path}: record {name!r} ({info.file_size} bytes at offset {offset}) runs past "
                f"the end of the file ({file_size} bytes); the file is truncated"
            )
        records[name] = Record(name, offset, info.file_size)
    if "data.pkl" not in records:
        raise CorruptCheckpointError(
            f"{path} is a zip archive but not a torch checkpoint: it has no data.pkl record"
        )
    return records


def parse_checksums(path: str, raw: bytes) -> dict[str, int]:
    """The digests recorded in a ``.fastpersist`` record."""
    try:
        doc = json.loads(raw)
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise ValueError("not a fastpersist checksum record")
        version = int(doc["version"])
        if version > FORMAT_VERSION:
            raise UnsupportedFormatError(
                f"{path} was written in {FORMAT_NAME} format version {version}; this fastpersist "
                f"reads versions up to {FORMAT_VERSION}: upgrade fastpersist to load it"
            )
        if doc["hash"] != HASH_NAME:
            raise ValueError(f"unknown hash {doc['hash']!r}")
        return {str(n): int(d, 16) for n, d in doc["records"].items()}
    except UnsupportedFormatError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CorruptCheckpointError(f"{path}: the {CHECKSUM_RECORD} record is damaged ({e})") from e
