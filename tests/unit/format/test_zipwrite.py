"""fastpersist's zip layout (format/zipwrite.py) against torch's own writer, byte for byte.

With no phase asked for, every record is placed as torch's writer (miniz) places it at 64-byte
alignment, so the two archives must be identical wherever torch wrote a byte: local headers,
padding, zip64 fields, data descriptors, the central directory and the end records. Records
of 4 GiB and more, and headers past 4 GiB, are laid out without their bytes (torch reserves
them with ``write_record_metadata``), so zip64 is compared too.
"""

from __future__ import annotations

import random

import pytest
import torch

from fastpersist.format import zipdir, zipwrite

GIB = 1 << 30


class _Sink:
    """What torch's writer writes, by offset (reserved records are skipped with a seek)."""

    def __init__(self) -> None:
        self.pos = 0
        self.chunks: list[tuple[int, bytes]] = []

    def write(self, data: object) -> int:
        b = bytes(memoryview(data))  # type: ignore[arg-type]
        if b:
            self.chunks.append((self.pos, b))
        self.pos += len(b)
        return len(b)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def flush(self) -> None:
        pass


def _torch_archive(records: list[tuple[str, int | bytes]]) -> _Sink:
    sink = _Sink()
    w = torch._C.PyTorchFileWriter(sink, False, zipwrite.RECORD_ALIGNMENT)  # type: ignore[call-overload]
    for name, data in records:
        if isinstance(data, bytes):
            w.write_record(name, data, len(data))
        else:
            w.write_record_metadata(name, data)
    w.write_end_of_file()
    return sink


def _ours(sink: _Sink, records: list[tuple[str, int | bytes]]) -> tuple[dict[int, bytes], int]:
    """The same records (and the ones torch added when closing), laid out by zipwrite."""
    listed = _directory_names(sink)
    data = {n: d for n, d in records}
    extra = _torch_trailer_bytes(sink, [n for n in listed if n not in data])
    image: dict[int, bytes] = {}
    placed = []
    pos = 0
    for name in listed:
        body = data.get(name, extra.get(name))
        nbytes = len(body) if isinstance(body, bytes) else int(body)  # type: ignore[arg-type]
        p = zipwrite.place(zipwrite.Entry(name, nbytes), pos)
        image[p.header_offset] = p.header
        if isinstance(body, bytes) and body:
            image[p.offset] = body
        if p.descriptor:
            image[p.offset + nbytes] = p.descriptor
        placed.append(p)
        pos = p.end
    image[pos] = zipwrite.directory(placed, pos)
    return image, pos + len(image[pos])


def _directory_names(sink: _Sink) -> list[str]:
    """The record names in the order torch wrote their local headers."""
    names = []
    for _, b in sink.chunks:
        if b.startswith(b"PK\x03\x04"):
            continue
        if b.startswith(b"archive/") and not b.startswith(b"PK"):
            names.append(b.decode().split("/", 1)[1])
    return names


def _torch_trailer_bytes(sink: _Sink, names: list[str]) -> dict[str, bytes]:
    """The bytes of the records torch added at the end (each written in one chunk after its
    header, name and extra field)."""
    out = {}
    chunks = sink.chunks
    for i, (_, b) in enumerate(chunks):
        if b.startswith(b"archive/") and b.decode().split("/", 1)[1] in names:
            k = i + 1
            while chunks[k][1].startswith((b"FB", b"\x01\x00")):  # zip64 field, padding field
                k += 1
            out[b.decode().split("/", 1)[1]] = chunks[k][1]
    return out


def _flatten(chunks: list[tuple[int, bytes]]) -> dict[int, int]:
    return {off + i: byte for off, b in chunks for i, byte in enumerate(b)}


CASES = {
    "small": [("data.pkl", b"\x80\x02}q\x00."), ("byteorder", b"little"), ("data/0", 4000), ("data/1", 0),
              ("data/2", 7)],
    "a record of 5 GiB": [("data.pkl", b"x" * 100), ("data/0", 5 * GIB), ("data/1", 100)],
    "headers past 4 GiB": [("data.pkl", b"x" * 10), ("data/0", 3 * GIB), ("data/1", 2 * GIB), ("data/2", 0),
                           ("data/3", 6 * GIB), ("data/4", 1)],
    "a record of exactly 2^32 - 1 bytes": [("data.pkl", b"x"), ("data/0", 2**32 - 1), ("data/1", 2**32 - 2)],
}


@pytest.mark.parametrize("records", list(CASES.values()), ids=list(CASES))
def test_the_layout_is_torch_s_byte_for_byte(records):
    sink = _torch_archive(records)
    image, size = _ours(sink, records)
    theirs = _flatten(sink.chunks)
    ours = _flatten(sorted(image.items()))
    assert size == sink.pos
    assert ours == theirs  # the same bytes at the same offsets, and none where torch wrote none


def test_random_records_lay_out_as_torch_lays_them_out():
    rng = random.Random(7)
    for _ in range(40):
        pickle = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300)))
        records: list[tuple[str, int | bytes]] = [("data.pkl", pickle)]
        for k in range(rng.randrange(1, 12)):
            size = rng.choice([0, 1, 63, 64, 65, 4095, 4096, rng.randrange(1, 1 << 20), rng.randrange(1, 6 * GIB)])
            records.append((f"data/{k}", size))
        sink = _torch_archive(records)
        image, size = _ours(sink, records)
        theirs = _flatten(sink.chunks)
        ours = _flatten(sorted(image.items()))
        assert size == sink.pos
        assert ours == theirs, records


def test_phased_records_start_at_their_phase_and_read_back():
    rng = random.Random(3)
    entries = [zipwrite.Entry("data.pkl", 50)]
    entries += [zipwrite.Entry(f"data/{k}", rng.randrange(1, 200_000), rng.randrange(0, 4096, 64)) for k in range(30)]
    entries += [zipwrite.Entry("data/30", 0, 128), zipwrite.Entry("version", 2)]
    raw = bytearray()
    placed = []
    for e in entries:
        p = zipwrite.place(e, len(raw))
        raw += p.header
        raw += bytes(p.offset - len(raw))
        raw += bytes([len(placed) % 251]) * e.nbytes + p.descriptor
        placed.append(p)
        if e.phase is not None and e.nbytes:
            assert p.offset % 4096 == e.phase
        else:
            assert p.offset % 64 == 0
    raw += zipwrite.directory(placed, len(raw))
    found = zipdir.read_directory("t.pt", zipdir.bytes_reader("t.pt", bytes(raw)), len(raw))
    assert [(r.name, r.offset, r.nbytes) for r in found] == [("archive/" + p.entry.name, p.offset, p.entry.nbytes)
                                                           for p in placed]
    for k, r in enumerate(found):
        assert raw[r.offset : r.offset + r.nbytes] == bytes([k % 251]) * r.nbytes


def test_a_bad_phase_or_size_is_refused():
    with pytest.raises(ValueError, match="phase"):
        zipwrite.place(zipwrite.Entry("data/0", 10, 4096), 0)
    with pytest.raises(ValueError, match="negative"):
        zipwrite.place(zipwrite.Entry("data/0", -1), 0)
