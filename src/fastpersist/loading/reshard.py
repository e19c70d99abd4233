"""Reading sharded tensors into any layout: each destination reads only the bytes it overlaps.

A sharded tensor is saved as chunks (boxes of the global tensor, row-major, cut into extents).
A destination is a box too: a DTensor's local shard at load time (any mesh, any placement), a
plain tensor holding the whole tensor, or a fresh full tensor. For every destination and every
saved chunk it meets, the intersection is read:

* **straight into the destination** when the intersection is one contiguous byte range both in
  the chunk and in the destination (same layout, or Shard(0) at another world size) and, when
  verifying, that range is made of whole extents: the extents' bytes go from the file to the
  destination's memory (O_DIRECT where the phases match), and are hashed there;
* otherwise **through a buffer**: the whole extents covering the intersection are read into a
  buffer, verified, and the intersection is copied out (Shard(0) -> Shard(1), sub-ranges).

Buffers are bounded (:data:`BUFFER_BYTES` at a time), so no rank ever materialises a whole
tensor it does not own. Every destination's global shape and dtype are checked before any byte
is read, so a mismatch loads nothing.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from fastpersist.config import IOConfig
from fastpersist.format import manifest as mf
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import ALIGN, align_up
from fastpersist.io.files import DirectFile
from fastpersist.io.reader import ReadFailedError, ReadRequest, allocate
from fastpersist.objects.files import check_in_memory, open_file
from fastpersist.objects.read import read_files

# Buffered intersections read at once (a larger single one is read alone).
BUFFER_BYTES = 256 << 20


@dataclass
class Target:
    """Fill ``dest`` (the box ``[offsets, offsets + dest.shape)`` of ``entry``'s global tensor).

    ``dest=None``: fresh memory, made by ``make`` (default: the whole tensor) for the box
    ``[offsets, offsets + size)`` once the files are open and sized, so a damaged manifest
    cannot make a load allocate more than the files hold."""

    entry: mf.ShardedEntry
    dest: torch.Tensor | None = None
    offsets: tuple[int, ...] = ()
    fresh: bool = False  # dest was never touched (faulted in ahead of the reads)
    size: tuple[int, ...] | None = None
    make: Callable[[], torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.dest is not None:
            return tuple(self.dest.shape)
        return self.size if self.size is not None else self.entry.shape

    def box(self) -> tuple[int, ...]:
        return self.offsets or (0,) * len(self.entry.shape)


def whole(path: str, entry: mf.ShardedEntry) -> torch.Tensor:
    """A fresh, page-aligned tensor of ``entry``'s global shape and dtype, the only user of a
    storage of exactly its bytes (as a tensor of a replicated load): where the aligned buffer
    lies in its allocation differs from process to process, and a tensor loaded here may be
    saved again as replicated state, whose layout every rank must agree on."""
    dtype = getattr(torch, entry.dtype)
    if not entry.nbytes:
        return torch.empty(entry.shape, dtype=dtype)
    buf = allocate(path, entry.nbytes)
    shift = int(buf.storage_offset())
    storage = buf.untyped_storage()[shift: shift + entry.nbytes]  # a view that keeps the allocation alive
    return torch.empty(0, dtype=dtype).set_(storage).view(entry.shape)


@dataclass
class _Part:
    """One (destination, chunk) intersection."""

    target: Target
    chunk: mf.ChunkEntry
    start: tuple[int, ...]  # global start of the intersection
    sizes: tuple[int, ...]
    lo: int  # its first and past-last byte in the chunk
    hi: int
    extents: list[mf.ExtentEntry] = field(default_factory=list)
    direct: bool = False
    addr: int = 0  # where the range (direct) or the extents' first byte (buffered) lands
    buffer: torch.Tensor | None = None
    flat_dest: int = 0  # a buffered byte range of a contiguous region: where byte ``lo`` goes (else 0)


def _row_major(sizes: Sequence[int]) -> list[int]:
    strides = [1] * len(sizes)
    for d in range(len(sizes) - 2, -1, -1):
        strides[d] = strides[d + 1] * sizes[d + 1]
    return strides


def _contiguous_in(box_sizes: Sequence[int], sizes: Sequence[int]) -> bool:
    """Is a sub-box of sizes ``box_sizes`` one contiguous range of a row-major array of ``sizes``?"""
    d = 0
    while d < len(sizes) and box_sizes[d] == 1:
        d += 1
    return all(b == s for b, s in zip(box_sizes[d + 1:], sizes[d + 1:]))


def intersect(a0: Sequence[int], an: Sequence[int], b0: Sequence[int], bn: Sequence[int]
              ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    start = tuple(max(x, y) for x, y in zip(a0, b0))
    end = tuple(min(x + n, y + m) for x, n, y, m in zip(a0, an, b0, bn))
    if any(e <= s for s, e in zip(start, end)):
        return None
    return start, tuple(e - s for s, e in zip(start, end))


def plan_parts(targets: Sequence[Target], verify: bool) -> list[_Part]:
    parts = []
    for t in targets:
        e = t.entry
        item = e.itemsize
        if t.dest is None:
            continue
        shape = tuple(t.dest.shape)
        dest_ok = t.dest.device.type == "cpu" and t.dest.is_contiguous()
        for c in e.chunks:
            met = intersect(t.offsets, shape, c.offsets, c.sizes)
            if met is None:
                continue
            start, sizes = met
            cs = _row_major(c.sizes)
            local = [s - o for s, o in zip(start, c.offsets)]
            first = sum(x * st for x, st in zip(local, cs))
            last = sum((x + n - 1) * st for x, n, st in zip(local, sizes, cs))
            p = _Part(t, c, start, sizes, first * item, (last + 1) * item)
            p.extents = [x for x in c.extents if x.start < p.hi and x.start + x.nbytes > p.lo]
            if not (dest_ok and _contiguous_in(sizes, c.sizes) and _contiguous_in(sizes, shape)):
                parts.append(p)  # buffered, copied out as a box
                continue
            ds = _row_major(shape)
            region = t.dest.data_ptr() + sum((s - o) * st for s, o, st in zip(start, t.offsets, ds)) * item
            parts += _contiguous_parts(p, region, verify)
    return parts


def _contiguous_parts(p: _Part, region: int, verify: bool) -> list[_Part]:
    """A region contiguous in the chunk and in the destination: the extents wholly inside it go
    straight to the destination; a partial extent at either end (when verifying: it must be
    read whole to be checked) goes through a buffer and its bytes in the region are copied."""
    def sub(lo: int, hi: int, extents: list[mf.ExtentEntry], direct: bool) -> _Part:
        q = _Part(p.target, p.chunk, p.start, p.sizes, lo, hi, extents, direct)
        if direct:
            q.addr = region + lo - p.lo
        else:
            q.flat_dest = region + lo - p.lo
        return q

    if not verify:
        return [sub(p.lo, p.hi, p.extents, True)]
    out = []
    inner = [x for x in p.extents if x.start >= p.lo and x.start + x.nbytes <= p.hi]
    head = [x for x in p.extents if x.start < p.lo]
    tail = [x for x in p.extents if x.start + x.nbytes > p.hi and x not in head]
    for x in head:
        out.append(sub(p.lo, min(p.hi, x.start + x.nbytes), [x], False))
    if inner:
        out.append(sub(inner[0].start, inner[-1].start + inner[-1].nbytes, inner, True))
    for x in tail:
        out.append(sub(max(p.lo, x.start), p.hi, [x], False))
    return out


def _span(p: _Part, verify: bool) -> tuple[int, int]:
    """The chunk bytes a part reads: whole extents when verifying a buffered part."""
    if verify and not p.direct:
        return p.extents[0].start, p.extents[-1].start + p.extents[-1].nbytes
    return p.lo, p.hi


def _requests(p: _Part, verify: bool) -> list[tuple[int, ReadRequest]]:
    lo, hi = _span(p, verify)
    out = []
    for x in p.extents:
        a, b = max(lo, x.start), min(hi, x.start + x.nbytes)
        n = b - a
        out.append((x.file, ReadRequest(x.offset + a - x.start, n, p.addr + a - lo, n,
                                        fresh=p.direct and p.target.fresh)))
    return out


def read_sharded(dirs: Sequence[str], manifest: mf.Manifest, targets: Sequence[Target], *, verify: bool,
                 config: IOConfig, backend: FileBackend | None = None) -> int:
    """Fill every target from checkpoint ``manifest`` (its directories ``dirs``); returns the
    bytes read. Errors name the tensor's key, the file and the offset."""
    wanted = {t.entry.path for t in targets}
    needed = sorted({x.file for t in targets for c in t.entry.chunks for x in c.extents
                     if intersect(t.box(), t.shape, c.offsets, c.sizes) is not None})
    files: dict[int, DirectFile] = {}
    cached: dict[int, DirectFile] = {}  # the same files through the page cache, for buffered parts

    def cached_file(index: int) -> DirectFile:
        if index not in cached:
            cached[index] = open_file(dirs, manifest, index, "off", backend)
        return cached[index]

    try:
        for index in needed:
            files[index] = open_file(dirs, manifest, index, config.direct, backend)
        for t in targets:
            if t.dest is None:
                t.dest = t.make() if t.make is not None else whole(dirs[0], t.entry)
                t.offsets, t.fresh = t.box(), True
        try:
            return _fill(dirs[0], targets, files, cached_file, verify=verify, config=config)
        except ReadFailedError as e:
            keys = sorted({mf.key_name(p) for p in wanted
                           for ent in manifest.sharded if ent.path == p for c in ent.chunks for x in c.extents
                           if files.get(x.file) is not None and files[x.file].path == e.path
                           and x.offset < e.offset + e.nbytes and e.offset < x.offset + x.nbytes})
            what = f" (sharded tensor{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys[:5]))})" if keys else ""
            raise ReadFailedError(f"{e}{what} of checkpoint step {manifest.step}", e.path, e.offset, e.nbytes) from e
    finally:
        for file in [*files.values(), *cached.values()]:
            file.close()


def _fill(path: str, targets: Sequence[Target], files: dict[int, DirectFile],
          cached_file: Callable[[int], DirectFile], *, verify: bool, config: IOConfig) -> int:
    parts = plan_parts(targets, verify)
    total = 0
    batch: list[_Part] = []
    held = 0
    for p in parts + [None]:  # type: ignore[list-item]
        if p is not None and not p.direct:
            lo, hi = _span(p, verify)
            need = align_up(hi - lo) + ALIGN
            if batch and held + need > BUFFER_BYTES:
                total += _run(path, batch, files, cached_file, verify, config)
                batch, held = [], 0
            held += need
        if p is None:
            total += _run(path, batch, files, cached_file, verify, config)
        else:
            batch.append(p)
    return total


def _run(path: str, parts: list[_Part], files: dict[int, DirectFile], cached_file: Callable[[int], DirectFile],
         verify: bool, config: IOConfig) -> int:
    """Read a batch of parts. Direct parts go to the destination with O_DIRECT; buffered parts
    (a slice of a chunk, as when resharding Shard(0) -> Shard(1)) are read through the page
    cache, so the ranks of a node that each need a slice of the same extents read them from the
    device once, not once per rank."""
    if not parts:
        return 0
    by_file: dict[int, list[ReadRequest]] = {}
    by_cached: dict[int, list[ReadRequest]] = {}
    for p in parts:
        if not p.direct:
            lo, hi = _span(p, verify)
            big = max(p.extents, key=lambda x: x.nbytes)
            buf = allocate(path, align_up(hi - lo) + 2 * ALIGN)
            phase = (big.offset - (big.start - lo)) % ALIGN  # the largest extent's file phase
            p.buffer = buf
            p.addr = buf.data_ptr() + phase
        for f, r in _requests(p, verify):
            (by_file if p.direct else by_cached).setdefault(f, []).append(r)
    read_files(files, by_file, config)
    read_files({f: cached_file(f) for f in by_cached}, by_cached, config)
    if verify:
        _verify(parts, files, config.reader_threads)
    for p in parts:
        if not p.direct:
            _copy_out(p, verify)
            p.buffer = None
    return sum(_span(p, verify)[1] - _span(p, verify)[0] for p in parts)


def _verify(parts: list[_Part], files: dict[int, DirectFile], threads: int) -> None:
    def describe(p: _Part, x: mf.ExtentEntry) -> Callable[[int], str]:
        return lambda got: (f"{files[x.file].path}: sharded tensor {p.target.entry.key!r} chunk at "
                            f"{list(p.chunk.offsets)} bytes {x.start}..{x.start + x.nbytes} (file offset {x.offset}) "
                            f"fail their checksum (stored {x.checksum:016x}, read {got:016x})")

    check_in_memory([(p.addr + x.start - (p.lo if p.direct else _span(p, True)[0]), x, describe(p, x))
                     for p in parts for x in p.extents], threads)


def _copy_out(p: _Part, verify: bool) -> None:
    t, c = p.target, p.chunk
    if t.dest is None:
        return
    lo_span = _span(p, verify)[0]
    if p.flat_dest:  # bytes of a contiguous region
        ctypes.memmove(p.flat_dest, p.addr + (p.lo - lo_span), p.hi - p.lo)
        return
    dtype = t.dest.dtype
    item = t.entry.itemsize
    lo, _ = _span(p, verify)
    buffer = p.buffer if p.buffer is not None else torch.empty(0, dtype=torch.uint8)
    base = p.addr - buffer.data_ptr()
    flat = buffer[base + (p.lo - lo): base + (p.hi - lo)]
    if flat.data_ptr() % item:  # keep element alignment for the typed view
        flat = flat.clone()
    src = flat.view(dtype)
    cs = _row_major(c.sizes)
    view = src.as_strided(p.sizes, cs, src.storage_offset())
    index = tuple(slice(s - o, s - o + n) for s, o, n in zip(p.start, t.offsets, p.sizes))
    with torch.no_grad():  # a parameter's local tensor requires grad; this is a load, not a step
        t.dest[index].copy_(view)

