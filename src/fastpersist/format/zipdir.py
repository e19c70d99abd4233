"""A strict reader of zip directories: torch archives and skeleton files. Pure: bytes in, records out.

Python's ``zipfile`` is lenient in ways a checkpoint reader cannot afford: it shifts every
offset by bytes found before the directory, accepts records that overlap or repeat, reads a
directory of any claimed size into memory, inflates compressed members without a bound, and
lets offsets from a damaged record surface as ``OSError``/``OverflowError``. This reader
accepts exactly the archives torch and fastpersist write, and refuses everything else with a
:class:`CorruptCheckpointError` naming the file:

- the end-of-central-directory record (and torch's zip64 records) must sit at the end of the
  file, single disk, with every offset and size inside the file;
- the directory is at most :data:`MAX_DIRECTORY_BYTES` and :data:`MAX_RECORDS` records;
- every record is *stored* (method 0, compressed size = size): compression is refused, so
  nothing is ever inflated;
- every record's local header is valid and names the same record; its bytes lie before the
  directory; no two records share a byte (header or data) and no name repeats.

Bytes are fetched through ``read_at(offset, nbytes)``, so the same code serves a file (pread)
and a skeleton already in memory.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

from fastpersist.errors import CorruptCheckpointError

MAX_DIRECTORY_BYTES = 64 << 20  # ~600,000 records of torch's size
MAX_RECORDS = 1 << 20

_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD_MAGIC = b"PK\x05\x06"
_LOCATOR = struct.Struct("<4sIQI")
_LOCATOR_MAGIC = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_EOCD64_MAGIC = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_CENTRAL_MAGIC = b"PK\x01\x02"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"
_U16, _U32 = 0xFFFF, 0xFFFFFFFF
_MAX_COMMENT = 0xFFFF

ReadAt = Callable[[int, int], bytes]


@dataclass(frozen=True)
class ZipRecord:
    name: str  # as stored, e.g. "archive/data/0"
    offset: int  # of the record's bytes in the file
    nbytes: int
    crc32: int
    header_offset: int


@dataclass(frozen=True)
class _Directory:
    offset: int
    size: int
    count: int
    end: int  # where the records must end: the directory's start


class _Fail:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path} is not a readable checkpoint archive: {what}; the file is truncated, "
            "damaged, or was not written by fastpersist.save / torch.save"
        )


def read_directory(path: str, read_at: ReadAt, size: int) -> list[ZipRecord]:
    """Every record of the zip archive of ``size`` bytes, validated as described above."""
    fail = _Fail(path)
    d = _find_directory(fail, read_at, size)
    raw = read_at(d.offset, d.size)
    records: list[ZipRecord] = []
    pos = 0
    for i in range(d.count):
        record, pos = _central_entry(fail, raw, pos, i)
        records.append(_locate(fail, read_at, record, d.end))
    if pos != d.size:
        raise fail(f"the directory holds {d.size - pos} bytes after its {d.count} records")
    _check_disjoint(fail, records, read_at)
    return records


def _find_directory(fail: _Fail, read_at: ReadAt, size: int) -> _Directory:
    if size < _EOCD.size:
        raise fail(f"it is {size} bytes, too short for a zip directory")
    tail_start = max(0, size - _EOCD.size - _MAX_COMMENT)
    tail = read_at(tail_start, size - tail_start)
    at = tail.rfind(_EOCD_MAGIC)
    while at >= 0:
        fields = _EOCD.unpack_from(tail, at) if at + _EOCD.size <= len(tail) else None
        if fields is not None and at + _EOCD.size + fields[7] == len(tail):
            return _directory(fail, read_at, tail_start + at, fields)
        at = tail.rfind(_EOCD_MAGIC, 0, at)
    raise fail("no end-of-directory record at its end")


def _directory(fail: _Fail, read_at: ReadAt, eocd: int, fields: tuple[int, ...]) -> _Directory:
    _, disk, cd_disk, n_disk, count, cd_size, cd_offset, _ = fields
    end = eocd
    if eocd >= _LOCATOR.size:
        loc = read_at(eocd - _LOCATOR.size, _LOCATOR.size)
        if loc[:4] == _LOCATOR_MAGIC:
            _, loc_disk, z64_offset, disks = _LOCATOR.unpack(loc)
            if loc_disk != 0 or disks != 1 or z64_offset + _EOCD64.size > eocd - _LOCATOR.size:
                raise fail("its zip64 locator points outside the file or to another disk")
            z = _EOCD64.unpack(read_at(z64_offset, _EOCD64.size))
            if z[0] != _EOCD64_MAGIC:
                raise fail(f"no zip64 end-of-directory record at offset {z64_offset}")
            disk, cd_disk, n_disk, count, cd_size, cd_offset = z[4], z[5], z[6], z[7], z[8], z[9]
            end = z64_offset
        elif _U16 in (count, n_disk) or _U32 in (cd_size, cd_offset):
            raise fail("its end-of-directory record needs a zip64 record, which is missing")
    if disk or cd_disk or n_disk != count:
        raise fail("it spans several disks")
    if cd_size > MAX_DIRECTORY_BYTES or count > MAX_RECORDS:
        raise fail(f"its directory claims {count} records in {cd_size} bytes, more than the limit "
                   f"({MAX_RECORDS} records, {MAX_DIRECTORY_BYTES} bytes)")
    if count * _CENTRAL.size > cd_size or cd_offset + cd_size > end:
        raise fail(f"its directory ({count} records, {cd_size} bytes at offset {cd_offset}) does not fit "
                   f"before the end-of-directory record at offset {end}")
    return _Directory(cd_offset, cd_size, count, cd_offset)


def _central_entry(fail: _Fail, raw: bytes, pos: int, i: int) -> tuple[ZipRecord, int]:
    if pos + _CENTRAL.size > len(raw):
        raise fail(f"directory entry #{i} runs past the directory")
    f = _CENTRAL.unpack_from(raw, pos)
    magic, flags, method, crc, csize, usize = f[0], f[3], f[4], f[7], f[8], f[9]
    nlen, xlen, clen, disk, header = f[10], f[11], f[12], f[13], f[16]
    end = pos + _CENTRAL.size + nlen + xlen + clen
    if magic != _CENTRAL_MAGIC or end > len(raw):
        raise fail(f"directory entry #{i} is damaged")
    try:
        name = raw[pos + _CENTRAL.size : pos + _CENTRAL.size + nlen].decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(f"directory entry #{i} has a name that is not UTF-8") from e
    extra = raw[pos + _CENTRAL.size + nlen : pos + _CENTRAL.size + nlen + xlen]
    usize, csize, header, disk = _zip64(fail, name, extra, usize, csize, header, disk)
    if method != 0 or csize != usize or flags & 0x1:
        raise fail(f"record {name!r} is compressed or encrypted (method {method}); checkpoint records are "
                   "always stored uncompressed")
    if disk:
        raise fail(f"record {name!r} is on another disk")
    return ZipRecord(name, -1, usize, crc, header), end


def _zip64(fail: _Fail, name: str, extra: bytes, usize: int, csize: int, header: int,
           disk: int) -> tuple[int, int, int, int]:
    """Sizes and offset from the zip64 extra field, where the 32-bit fields say to look."""
    wanted = [v == _U32 for v in (usize, csize, header)] + [disk == _U16]
    if not any(wanted):
        return usize, csize, header, disk
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            values = [usize, csize, header, disk]
            at = pos + 4
            for k, want in enumerate(wanted):
                if want:
                    width = 4 if k == 3 else 8
                    if at + width > pos + 4 + n:
                        raise fail(f"record {name!r} has a short zip64 field")
                    values[k] = int.from_bytes(extra[at : at + width], "little")
                    at += width
            return values[0], values[1], values[2], values[3]
        pos += 4 + n
    raise fail(f"record {name!r} needs a zip64 field, which is missing")


def _locate(fail: _Fail, read_at: ReadAt, r: ZipRecord, end: int) -> ZipRecord:
    """The record with the offset of its bytes, from its local header."""
    if r.header_offset + _LOCAL.size > end:
        raise fail(f"record {r.name!r} has its header at offset {r.header_offset}, past the records' end ({end})")
    f = _LOCAL.unpack(read_at(r.header_offset, _LOCAL.size))
    offset = r.header_offset + _LOCAL.size + f[9] + f[10]
    if f[0] != _LOCAL_MAGIC or offset > end:
        raise fail(f"record {r.name!r} has no valid local header at offset {r.header_offset}")
    if r.nbytes > end - offset:
        raise fail(f"record {r.name!r} ({r.nbytes} bytes at offset {offset}) runs past the records' end "
                   f"({end})")
    if read_at(r.header_offset + _LOCAL.size, f[9]) != r.name.encode("utf-8"):
        raise fail(f"record {r.name!r}: its local header names another record")
    return ZipRecord(r.name, offset, r.nbytes, r.crc32, r.header_offset)


def _check_disjoint(fail: _Fail, records: list[ZipRecord], read_at: ReadAt) -> None:
    """No repeated name; no two records (local header to last byte) share a byte."""
    names: set[str] = set()
    for r in records:
        if r.name in names:
            raise fail(f"record {r.name!r} is listed twice")
        names.add(r.name)
    spans = sorted((r.header_offset, r.offset + r.nbytes, r.name) for r in records)
    for (_, a_end, a), (b_start, _, b) in zip(spans, spans[1:]):
        if b_start < a_end:
            raise fail(f"records {a!r} and {b!r} overlap")


def bytes_reader(path: str, raw: bytes) -> ReadAt:
    """``read_at`` over bytes in memory; reading past the end is truncation."""

    def read_at(offset: int, nbytes: int) -> bytes:
        if offset + nbytes > len(raw):
            raise CorruptCheckpointError(f"{path} is truncated: {nbytes} bytes expected at offset {offset}, "
                                         f"but it is {len(raw)} bytes long")
        return raw[offset : offset + nbytes]

    return read_at
