"""The single-file layout: a torch zip archive whose large storage records start at their memory's phase.

fastpersist lets torch's serializer decide what the archive holds (so plain ``torch.load``
reads the result) but lays the archive out itself and keeps the storage bytes for its own write
engine. :func:`layout` runs ``torch.serialization._save`` against a recorder that keeps every
record torch hands it (the pickle, the small records, each storage by reference: no storage
byte is copied), then places the records with :mod:`fastpersist.format.zipwrite`, the archive
miniz writes with the padding chosen per record: a large storage starts on a page, or, with
``IOConfig.single_file_zero_copy``, at its own memory's 4 KiB phase, so the writer sends its
page-aligned middle straight from the tensor (O_DIRECT, no copy); smaller records start on
64-byte boundaries, as torch places them.

torch's ``.format_version`` record is not written: with it, torch's loader may compute a
storage's offset from the previous record's end assuming its own fixed padding
(``torch.utils.serialization.config.load.calculate_storage_offsets``, the offsets it gives
tensors loaded on the meta device) instead of reading the record's header, and those offsets
would be wrong here. Without it, torch reads every offset from the record's local header, as
it does for archives of torch before 2.1. ``.storage_alignment``, which only that arithmetic
reads, is not written either.

After the storage records, fastpersist adds one record of its own, ``.fastpersist``, holding a
JSON document with the xxh3-64 digest of every other record. torch ignores it; ``load`` uses it
to verify what it read. The record has a fixed size known before the digests, so it is placed
with the others and filled last. Its format is specified in docs/FORMAT.md.
"""

from __future__ import annotations

import json
import os
import pickle
import re
from dataclasses import dataclass, field

import torch
import xxhash

from fastpersist import torch_internals
from fastpersist.errors import CorruptCheckpointError, UnsaveableObjectError, UnsupportedFormatError
from fastpersist.format import jsondoc, skeleton, zipdir, zipwrite

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
# torch's records fastpersist does not write (see above); files of earlier versions have them.
DROPPED_RECORDS = frozenset({".format_version", ".storage_alignment"})


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

    ``chunks`` are the archive's bytes (offset, bytes) before ``body_end``, storages aside;
    ``tail`` is every byte from ``body_end`` to the end of the file, with the checksum record
    still blank at ``checksum_offset`` (relative to the file).
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


class _Recorder:
    """Stands in for torch's zip writer inside ``torch.serialization._save``: keeps every record
    torch hands it, in order, and writes nothing. Storage records keep their storage (no byte
    is copied); ``.format_version`` and ``.storage_alignment`` are dropped (see the module
    docstring)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, bytes | torch.UntypedStorage, int]] = []

    def write_record(self, name: str, data: object, nbytes: int) -> None:
        if isinstance(data, (torch.UntypedStorage, torch.TypedStorage)):
            storage = data if isinstance(data, torch.UntypedStorage) else data._untyped_storage
            self.records.append((name, storage, nbytes))
            return
        if name in DROPPED_RECORDS:
            return
        raw = data.encode() if isinstance(data, str) else bytes(data)  # type: ignore[call-overload]
        self.records.append((name, raw[:nbytes], nbytes))

    def write_record_metadata(self, name: str, nbytes: int) -> None:
        raise UnsaveableObjectError("fastpersist cannot save while torch's skip_data mode is active")


class _Sink:
    """A file-like object holding what torch's own writer writes (the trailing records)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.pos = 0

    def write(self, data: object) -> int:
        b = memoryview(data).cast("B")  # type: ignore[arg-type]
        end = self.pos + len(b)
        if end > len(self.buf):
            self.buf.extend(bytes(end - len(self.buf)))
        self.buf[self.pos : end] = b
        self.pos = end
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence not in (0, 1):
            raise OSError("fastpersist's sink only seeks from the start or the current position")
        self.pos = offset if whence == 0 else self.pos + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _trailing_records(have: set[str]) -> list[tuple[str, bytes]]:
    """The records torch's writer adds when it closes an archive (``version``,
    ``.data/serialization_id``: a new id for every file), taken from torch's own writer closing
    an empty archive, less those ``have`` holds."""
    sink = _Sink()
    writer = torch_internals.file_writer(sink, False, zipwrite.RECORD_ALIGNMENT)
    writer.write_end_of_file()
    raw = bytes(sink.buf)
    out = []
    for r in zipdir.read_directory("torch's writer", zipdir.bytes_reader("torch's writer", raw), len(raw)):
        name = r.name.split("/", 1)[-1]
        if name not in have:
            out.append((name, raw[r.offset : r.offset + r.nbytes]))
    return out


def layout(obj: object, pickle_protocol: int = 2, *, phase_from: int = 1 << 20, phased: bool = True) -> Layout:
    """Lay ``obj`` out as a torch zip archive.

    A storage of ``phase_from`` bytes (at least a page) or more starts, with ``phased``, at its
    memory's 4 KiB phase if it is a host storage at a 16-byte aligned address (numpy's
    alignment; a loaded tensor keeps it, and it suits every dtype), and on a page boundary
    otherwise; every other record starts on a 64-byte boundary, as torch places them.

    Raises :class:`UnsaveableObjectError` when torch's serializer rejects the object.
    """
    rec = _Recorder()
    try:
        with skeleton.collector_paused():
            torch_internals.save_records(obj, rec, pickle, pickle_protocol)
    except UnsaveableObjectError:
        raise
    except Exception as e:
        raise UnsaveableObjectError(f"the object cannot be serialized: {type(e).__name__}: {e}") from e
    chunks: list[tuple[int, bytes]] = []
    placed: list[zipwrite.Placed] = []
    storages: list[StorageRecord] = []
    small_digests: dict[str, int] = {}
    pos = 0
    for name, data, nbytes in rec.records:
        if isinstance(data, torch.UntypedStorage):
            p = zipwrite.place(zipwrite.Entry(name, nbytes, _phase(data, nbytes, phase_from, phased)), pos)
            if nbytes:
                storages.append(StorageRecord(name, data, p.offset, nbytes))
            chunks.append((p.header_offset, p.header))
        else:
            p = zipwrite.place(zipwrite.Entry(name, nbytes), pos)
            small_digests[name] = xxhash.xxh3_64_intdigest(data)
            chunks.append((p.header_offset, p.header))
            if nbytes:
                chunks.append((p.offset, data))
        if p.descriptor:
            chunks.append((p.offset + nbytes, p.descriptor))
        placed.append(p)
        pos = p.end
    body_end = pos
    names = sorted(small_digests) + [s.name for s in storages]
    size = len(_checksum_document({n: 0 for n in names}))
    tail_placed = [zipwrite.place(zipwrite.Entry(CHECKSUM_RECORD, size), pos)]
    pos = tail_placed[0].end
    trailing = _trailing_records({r[0] for r in rec.records})
    for name, data in trailing:
        tail_placed.append(zipwrite.place(zipwrite.Entry(name, len(data)), pos))
        pos = tail_placed[-1].end
    tail = bytearray(pos - body_end)
    for p, data in zip(tail_placed, [b""] + [d for _, d in trailing]):
        for at, b in ((p.header_offset, p.header), (p.offset, data), (p.offset + p.entry.nbytes, p.descriptor)):
            tail[at - body_end : at - body_end + len(b)] = b
    tail += zipwrite.directory(placed + tail_placed, pos)
    return Layout(chunks, storages, small_digests, body_end, tail, tail_placed[0].offset, names)


def _phase(storage: torch.UntypedStorage, nbytes: int, phase_from: int, phased: bool) -> int | None:
    if nbytes < max(phase_from, zipwrite.PAGE):  # smaller ones are staged whatever their offset
        return None
    # torch's _save hands over host copies of device storages, so the address is a host one
    addr = int(storage.data_ptr())
    return addr % zipwrite.PAGE if phased and storage.device.type == "cpu" and addr % 16 == 0 else 0


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
