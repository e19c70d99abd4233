"""The reference state, its checkpoints in both formats, and byte-level tools to edit them.

Shared by the named hostile-input tests and the fuzz cases. Everything is real: files written
by fastpersist itself, then edited in place the way damage or an attacker would.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import struct
import zlib
from typing import Any

import torch
import xxhash
from helpers import states_equal

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer
from fastpersist.format import manifest as mf
from fastpersist.format import torchzip

STEP = "step-00000001"


def reference_state() -> dict[str, Any]:
    """Small but varied: equal-size tensors (swappable), a view, tied, odd dtypes, empty."""
    g = torch.Generator().manual_seed(14)
    a = torch.randn(2048, generator=g)
    return {
        "a": a,
        "b": torch.randn(2048, generator=g),  # same size as a
        "view": a[100:300],
        "tied": a,
        "big": torch.randn(40_000, generator=g),  # > 64 KiB: an aligned extent
        "bf16": torch.randn(333, generator=g).to(torch.bfloat16),
        "i8": torch.randint(-100, 100, (4097,), generator=g, dtype=torch.int8),
        "bool": torch.rand(5, generator=g) > 0.5,
        "t": torch.randn(7, 9, generator=g).t(),
        "empty": torch.empty(0),
        "nested": {"list": [torch.arange(3), 7], "s": "text"},
        "step": 3,
    }


def equal(a: object, b: object) -> bool:
    """Bit-exact equality, the test suite's one (helpers.states_equal): structure, dtype, shape,
    stride, storage sharing and the bytes."""
    return states_equal(a, b)


def save_single(path: str) -> str:
    fp.save(reference_state(), path)
    return path


def save_sharded(root_dir: str) -> list[str]:
    """A checkpoint of the reference state over two roots; returns the roots."""
    roots = [os.path.join(root_dir, "r0"), os.path.join(root_dir, "r1")]
    with Checkpointer(roots, mode="sync") as ck:
        ck.save(1, reference_state())
    return roots


# ---- sharded: the manifest ----------------------------------------------------------------


def manifest_path(roots: list[str]) -> str:
    return os.path.join(roots[0], STEP, mf.MANIFEST_NAME)


def read_doc(roots: list[str]) -> dict[str, Any]:
    with open(manifest_path(roots), "rb") as f:
        return json.loads(f.read())


def write_doc(roots: list[str], doc: dict[str, Any], *, reseal: bool = True, raw_values: dict[str, str] | None = None) -> None:
    """Write the manifest compactly; with ``reseal`` its own checksum is recomputed (what an
    attacker would do), else the stale one is kept. ``raw_values`` replaces placeholder strings
    with raw JSON text (``Infinity``, ``1e400``...)."""
    doc = dict(doc)
    stale = doc.pop("manifest_checksum", None)
    body = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    for placeholder, text in (raw_values or {}).items():
        body = body.replace(json.dumps(placeholder), text)
    raw = body.encode()
    if reseal:
        raw = seal(raw)
    elif stale is not None:
        raw = raw[:-1] + b',"manifest_checksum":"%s"}' % stale.encode()
    with open(manifest_path(roots), "wb") as f:
        f.write(raw)


def seal(body: bytes) -> bytes:
    """The manifest's own checksum as docs/FORMAT.md specifies it (written here from the spec,
    not by calling the library): xxh3-64 of the compact body, appended as the last field."""
    return body[:-1] + b',"manifest_checksum":"%016x"}' % xxhash.xxh3_64_intdigest(body)


def file_of(roots: list[str], doc: dict[str, Any], index: int) -> str:
    f = doc["files"][index]
    return os.path.join(roots[f["root"]], STEP, f["name"])


def skeleton_path(roots: list[str], doc: dict[str, Any]) -> str:
    return file_of(roots, doc, doc["objects"]["replicated"]["skeleton"]["file"])


def replace_skeleton(roots: list[str], raw: bytes) -> None:
    """Put ``raw`` in place of the replicated skeleton with the manifest updated to match it
    (size, checksum, own checksum): a hostile skeleton that passes every integrity check."""
    doc = read_doc(roots)
    sk = doc["objects"]["replicated"]["skeleton"]
    with open(skeleton_path(roots, doc), "wb") as f:
        f.write(raw)
    sk["nbytes"] = len(raw)
    sk["checksum"] = f"{xxhash.xxh3_64_intdigest(raw):016x}"
    doc["files"][sk["file"]]["size"] = len(raw)
    write_doc(roots, doc)


# ---- zip archives, written by hand ----------------------------------------------------------


def zip_bytes(members: list[tuple[str, bytes]], *, method: int = 0, raw_data: dict[str, bytes] | None = None,
              sizes: dict[str, int] | None = None) -> bytes:
    """A zip archive (no zip64) of ``members``; ``method`` 8 deflates ``raw_data``'s entries
    (their compressed bytes given), with uncompressed ``sizes``."""
    out = bytearray()
    central = bytearray()
    for name, data in members:
        stored = (raw_data or {}).get(name, data)
        usize = (sizes or {}).get(name, len(data))
        m = method if raw_data and name in raw_data else 0
        crc = zlib.crc32(data) if not raw_data or name not in raw_data else 0
        nb = name.encode()
        header = len(out)
        out += struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 20, 0, m, 0, 0, crc, len(stored), usize, len(nb), 0) + nb
        out += stored
        central += struct.pack("<4sHHHHHHIIIHHHHHII", b"PK\x01\x02", 20, 20, 0, m, 0, 0, crc, len(stored), usize,
                               len(nb), 0, 0, 0, 0, 0, header) + nb
    cd_offset = len(out)
    out += central
    out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(members), len(members), len(central), cd_offset, 0)
    return bytes(out)


@functools.lru_cache(maxsize=8)
def deflate_bomb(nbytes: int) -> bytes:
    """Deflated bytes that inflate to ``nbytes`` zeros (about 1000:1)."""
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    chunk = bytes(1 << 20)
    out = bytearray()
    left = nbytes
    while left:
        n = min(left, len(chunk))
        out += c.compress(chunk[:n])
        left -= n
    return bytes(out + c.flush())


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def evil_pickle(marker: str) -> bytes:
    """A pickle that creates ``marker`` when unpickled by a full unpickler."""
    return pickle.dumps({"x": _Evil(marker)}, protocol=2)


# ---- single file: records and directory ---------------------------------------------------


def records(path: str) -> dict[str, torchzip.Record]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return torchzip.read_directory(path, fd, os.path.getsize(path))
    finally:
        os.close(fd)


def central_entries(raw: bytes) -> list[tuple[int, str]]:
    """(offset in the file, name) of every central directory entry."""
    out = []
    pos = raw.find(b"PK\x01\x02")
    while pos >= 0:
        nlen = struct.unpack_from("<H", raw, pos + 28)[0]
        out.append((pos, raw[pos + 46 : pos + 46 + nlen].decode("utf-8", "replace")))
        pos = raw.find(b"PK\x01\x02", pos + 46 + nlen)
    return out


def eocd_offset(raw: bytes) -> int:
    return raw.rfind(b"PK\x05\x06")


def flip(path: str, offset: int, mask: int = 0x10) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
