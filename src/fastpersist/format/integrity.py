"""Which checksums a single file carries, and checking its records against them.

A file fastpersist wrote carries a ``.fastpersist`` record: the xxh3-64 digest of every record
written before it. A file plain ``torch.save`` wrote carries a CRC-32 per record in its zip
directory. fastpersist writes its zip directory with CRC-32 fields of 0 (torch's CRC would cap
the save at one core's speed), so **a file whose every non-empty record has a CRC-32 of 0 is a
fastpersist file** (or one saved with torch's CRC turned off): it can only be verified through
its ``.fastpersist`` record, and if that record is gone (removed, renamed) the file is
*unverified*, never "matching". The rules, in order:

1. ``.fastpersist`` present: it must parse, list every record but itself, torch's trailing
   records and empty storages, and every listed record must match its digest;
2. else, some non-empty record has a non-zero CRC-32: every record must match its CRC-32;
3. else: :class:`UnverifiedCheckpointError`.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

import xxhash

from fastpersist.errors import ChecksumMismatchError, UnverifiedCheckpointError
from fastpersist.format import torchzip

RecordBytes = Callable[[str], "memoryview | bytes"]


def check(path: str, records: Mapping[str, torchzip.Record], small: Mapping[str, bytes],
          data: RecordBytes, threads: int, in_file_order: bool = False) -> str:
    """Verify every record of the file at ``path``; returns what it was checked against
    (``"xxh3-64"`` or ``"CRC-32"``). Raises :class:`ChecksumMismatchError` or
    :class:`UnverifiedCheckpointError`, naming the file and the record.

    Records are hashed largest first, or, with ``in_file_order``, in the order they lie in the
    file (``data`` then waits for each record's bytes as they are read)."""
    if torchzip.CHECKSUM_RECORD in small:
        expected = torchzip.parse_checksums(path, small[torchzip.CHECKSUM_RECORD])
        _check_coverage(path, records, expected)
        _compare(path, records, expected, data, threads, xxhash.xxh3_64_intdigest, "xxh3-64", 16, in_file_order)
        return torchzip.HASH_NAME
    if any(r.crc32 for r in records.values()):
        crcs = {n: r.crc32 for n, r in records.items()}
        _compare(path, records, crcs, data, threads, zlib.crc32, "CRC-32", 8, in_file_order)
        return "CRC-32"
    raise UnverifiedCheckpointError(
        f"{path} carries no checksums: it has no {torchzip.CHECKSUM_RECORD} record and its zip directory "
        "holds no CRC-32s (a fastpersist file whose checksum record was removed or renamed, or a file saved "
        "with torch's CRC turned off). Load it with verify=False only if you accept unverified bytes"
    )


def _check_coverage(path: str, records: Mapping[str, torchzip.Record], expected: Mapping[str, int]) -> None:
    missing = sorted(n for n in expected if n not in records)
    if missing:
        raise ChecksumMismatchError(f"{path}: records {missing[:5]} are listed in its checksums but missing; "
                                    "the file is damaged")
    unlisted = sorted(n for n, r in records.items() if n not in expected and r.nbytes
                      and n != torchzip.CHECKSUM_RECORD and n not in torchzip.TRAILING_RECORDS)
    if unlisted:
        raise ChecksumMismatchError(f"{path}: records {unlisted[:5]} are not covered by its checksum record; "
                                    "the file is damaged or was edited")


def _compare(path: str, records: Mapping[str, torchzip.Record], expected: Mapping[str, int], data: RecordBytes,
             threads: int, digest: Callable[..., int], kind: str, width: int, in_file_order: bool) -> None:
    names = sorted(expected, key=(lambda n: records[n].offset) if in_file_order else (lambda n: -records[n].nbytes))
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastpersist-verify") as ex:
        got = dict(zip(names, ex.map(lambda n: digest(data(n)), names)))
    for n in sorted(expected):
        if got[n] != expected[n]:
            r = records[n]
            raise ChecksumMismatchError(
                f"{path}: record {n!r} ({r.nbytes} bytes at offset {r.offset}) fails its {kind} "
                f"(stored {expected[n]:0{width}x}, read {got[n]:0{width}x}); the file is corrupt"
            )
