"""The zip archive of a single-file checkpoint, laid out by fastpersist. Pure: names and sizes in, bytes out.

torch writes its archives with miniz (``PyTorchFileWriter``), padding every record's bytes to
one alignment. A single-file checkpoint wants more: each large storage record should start at
its tensor's own 4 KiB phase (the record's file offset and the storage's memory address equal
modulo 4096), so that the write engine sends the record's page-aligned middle to the disk
straight from the tensor with O_DIRECT instead of copying it through the staging pool
(:func:`fastpersist.io.writer._direct_span`). torch's allocator puts tensors 64 bytes into a
page as often as on a page boundary, so one fixed alignment cannot do it.

This module writes the archive miniz writes, structure for structure: a local header with
version 0, flags 0x0808 (UTF-8 names, a data descriptor after the bytes; 0x0800 and no
descriptor for an empty record), no CRC-32 (fastpersist's checksums live in their own record),
sizes in the descriptor; torch's ``FB`` padding extra field; zip64 fields exactly where miniz
puts them (a record of 2^32-1 bytes or more, or one whose header starts at or past 2^32-1);
and the zip64 end-of-directory records, which miniz always writes. Only the padding of each
record is chosen here: the caller gives the phase each record's bytes must start at.

Readers find each record's bytes through its local header (torch's ``get_record_offset``,
fastpersist's :mod:`fastpersist.format.zipdir`), so they read these archives as they read
torch's. torch's optional offset arithmetic (``calculate_storage_offsets``), which assumes its
own padding, is only used for archives with a ``.format_version`` record; fastpersist does not
write one (docs/FORMAT.md).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

PAGE = 4096
RECORD_ALIGNMENT = 64  # torch's default alignment, kept for records without a phase
PREFIX = "archive/"

_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_DESCRIPTOR32 = struct.Struct("<IIII")
_DESCRIPTOR64 = struct.Struct("<IIQQ")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
_LOCAL_SIG, _CENTRAL_SIG, _DESC_SIG = 0x04034B50, 0x02014B50, 0x08074B50
_EOCD64_SIG, _LOCATOR_SIG, _EOCD_SIG = 0x06064B50, 0x07064B50, 0x06054B50
_FLAGS_DATA, _FLAGS_EMPTY = 0x0808, 0x0800
_PAD_ID = b"FB"


@dataclass(frozen=True)
class Entry:
    """A record to lay out: its name inside the archive folder, its size, and the phase (offset
    modulo 4096) its bytes must start at; None: the next 64-byte boundary, as torch does."""

    name: str
    nbytes: int
    phase: int | None = None


@dataclass(frozen=True)
class Placed:
    """Where a record went: its local header (bytes, at ``header_offset``), its bytes at
    ``offset``, and the data descriptor that follows them (empty for an empty record)."""

    entry: Entry
    header_offset: int
    header: bytes
    offset: int
    descriptor: bytes

    @property
    def end(self) -> int:
        return self.offset + self.entry.nbytes + len(self.descriptor)


def _zip64_field(values: Sequence[int]) -> bytes:
    return struct.pack("<HH", 1, 8 * len(values)) + b"".join(struct.pack("<Q", v) for v in values)


def place(entry: Entry, at: int) -> Placed:
    """Lay ``entry`` out with its local header at file offset ``at``."""
    if entry.nbytes < 0:
        raise ValueError(f"record {entry.name!r} has a negative size")
    name = (PREFIX + entry.name).encode("utf-8")
    big = entry.nbytes >= _U32
    far = at >= _U32
    zip64 = _zip64_field(([entry.nbytes, 0] if big else []) + ([at] if far else [])) if big or far else b""
    fixed = at + _LOCAL.size + len(name) + len(zip64) + 4  # + the padding field's own header
    if entry.phase is None:
        offset = -(-fixed // RECORD_ALIGNMENT) * RECORD_ALIGNMENT
    else:
        if not 0 <= entry.phase < PAGE:
            raise ValueError(f"record {entry.name!r}: phase {entry.phase} is not in [0, {PAGE})")
        offset = fixed + (entry.phase - fixed) % PAGE
    pad = offset - fixed
    extra = zip64 + _PAD_ID + struct.pack("<H", pad) + b"Z" * pad
    flags = _FLAGS_DATA if entry.nbytes else _FLAGS_EMPTY
    header = _LOCAL.pack(_LOCAL_SIG, 0, flags, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra
    if not entry.nbytes:
        descriptor = b""
    elif big or far:
        descriptor = _DESCRIPTOR64.pack(_DESC_SIG, 0, entry.nbytes, entry.nbytes)
    else:
        descriptor = _DESCRIPTOR32.pack(_DESC_SIG, 0, entry.nbytes, entry.nbytes)
    return Placed(entry, at, header, offset, descriptor)


def directory(placed: Sequence[Placed], at: int) -> bytes:
    """The central directory of ``placed``, starting at file offset ``at``, and the end
    records (zip64 end of directory, its locator, the end of directory) that end the file."""
    out = bytearray()
    for p in placed:
        name = (PREFIX + p.entry.name).encode("utf-8")
        n, h = p.entry.nbytes, p.header_offset
        zip64 = [v for v in (n, n, h) if v >= _U32]
        extra = _zip64_field(zip64) if zip64 else b""
        flags = _FLAGS_DATA if n else _FLAGS_EMPTY
        out += _CENTRAL.pack(_CENTRAL_SIG, 0, 0, flags, 0, 0, 0, 0, min(n, _U32), min(n, _U32), len(name), len(extra),
                             0, 0, 0, 0, min(h, _U32))
        out += name + extra
    size = len(out)
    eocd64_at = at + size
    count = len(placed)
    out += _EOCD64.pack(_EOCD64_SIG, _EOCD64.size - 12, 0x031E, 0x002D, 0, 0, count, count, size, at)
    out += _LOCATOR.pack(_LOCATOR_SIG, 0, eocd64_at, 1)
    out += _EOCD.pack(_EOCD_SIG, 0, 0, min(count, _U16), min(count, _U16), min(size, _U32), min(at, _U32), 0)
    return bytes(out)
