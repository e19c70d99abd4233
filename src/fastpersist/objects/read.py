"""Reading an object of a sharded checkpoint: every extent, in parallel, into one host buffer.

:func:`read_object` lays the buffer out so that each large extent's file offset and memory
address share their phase (O_DIRECT again), merges nearby extents into one request
(:func:`merge_spans`, shared with the DCP layer's reader), verifies every checksum in memory
and hands the buffer with the skeleton to torch's loader; the object's tensors are views of
that buffer, with no copy after the read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

from fastpersist.config import IOConfig
from fastpersist.errors import CheckpointReadError
from fastpersist.format import manifest as mf
from fastpersist.format import references, skeleton
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import ALIGN, align_up
from fastpersist.io.files import DirectFile
from fastpersist.io.reader import (
    Landed,
    ReadFailedError,
    ReadRequest,
    ReadsStopped,
    allocate,
    read_into,
    read_then_rebuild,
)
from fastpersist.objects.files import (
    ELEMENT_ALIGN,
    check_in_memory,
    check_unverified,
    extent_problem,
    file_path,
    manifest_path,
    needed_files,
    open_file,
    read_skeleton,
)

# Packed extents closer than this in a file are read with one request (the gap is read too).
MERGE_GAP = 64 * 1024


def merge_spans(spans: Sequence[tuple[int, int]], gap: int = MERGE_GAP) -> list[tuple[int, int, list[int]]]:
    """Runs of sorted (file offset, nbytes) spans closer than ``gap``, each read with one
    request: (start, nbytes, indices of its spans)."""
    runs: list[tuple[int, int, list[int]]] = []
    for i, (offset, n) in enumerate(spans):
        if runs and offset - (runs[-1][0] + runs[-1][1]) <= gap:
            start, length, members = runs[-1]
            runs[-1] = (start, max(start + length, offset + n) - start, members + [i])
        else:
            runs.append((offset, n, [i]))
    return runs


def buffer_areas(spans: Sequence[tuple[int, int]], pos: int = 0) -> tuple[list[int], int]:
    """Where each (file offset, nbytes) span goes in a read buffer from ``pos`` on (at the same
    4 KiB phase as in its file, so the reads are O_DIRECT), and the buffer's end."""
    areas = []
    for start, n in spans:
        area = align_up(pos) + start % ALIGN
        areas.append(area)
        pos = align_up(area + n)
    return areas, pos


def read_plan(entry: mf.ObjectEntry) -> tuple[list[int], int, dict[int, list[tuple[int, int, int, int]]]]:
    """Where every storage goes in the read buffer, the buffer's size, and the reads.

    Storages held whole by one extent at an element-aligned offset are read *in runs*: the
    extents of a file that lie close together are read with one request into one area of the
    buffer that mirrors the file, so many small storages cost one large O_DIRECT read. A storage
    cut over several files gets its own area (at the phase of its largest extent, so its reads
    are O_DIRECT too). Reads are (file offset, nbytes, buffer offset, capacity) per file.
    """
    storages = entry.storages
    bases = [0] * len(storages)
    reads: dict[int, list[tuple[int, int, int, int]]] = {}
    pos = 0
    whole: dict[int, list[tuple[int, int, int]]] = {}  # file -> (offset, nbytes, storage)
    separate = []
    for i, s in enumerate(storages):
        if len(s.extents) == 1 and s.extents[0].offset % ELEMENT_ALIGN == 0:
            e = s.extents[0]
            whole.setdefault(e.file, []).append((e.offset, e.nbytes, i))
        elif s.extents:
            separate.append(i)
    for f, spans in sorted(whole.items()):
        spans.sort()
        runs = merge_spans([(offset, n) for offset, n, _ in spans])
        areas, pos = buffer_areas([(start, n) for start, n, _ in runs], pos)
        for (start, n, members), area in zip(runs, areas):
            for k in members:
                bases[spans[k][2]] = area + spans[k][0] - start
            reads.setdefault(f, []).append((start, n, area, align_up(area + n) - area))
    for i in separate:
        s = storages[i]
        big = max(s.extents, key=lambda e: e.nbytes)
        base = align_up(pos) + (big.offset - big.start) % ALIGN
        bases[i] = base
        for e in s.extents:
            last = e.start + e.nbytes == s.nbytes  # only the last extent may read into the slack
            capacity = align_up(base + s.nbytes) - base - e.start if last else e.nbytes
            reads.setdefault(e.file, []).append((e.offset, e.nbytes, base + e.start, capacity))
        pos = align_up(base + s.nbytes)
    return bases, align_up(pos), reads


def read_object(dirs: Sequence[str], manifest: mf.Manifest, name: str, *, map_location: Any,
                weights_only: bool, verify: bool, config: IOConfig, backend: FileBackend | None = None) -> Any:
    """Read, verify and rebuild object ``name`` of a checkpoint whose directories are ``dirs``.

    Every file is opened (regular, not a link, at least its listed size) and the skeleton is
    checked against the storages before the read buffer is allocated, so a damaged manifest
    cannot make load allocate more than the files hold.
    """
    if name not in manifest.objects:
        raise CheckpointReadError(f"{manifest_path(dirs)}: the checkpoint of step {manifest.step} holds no "
                                  f"object {name!r}")
    if verify:
        check_unverified(dirs, manifest)
    entry = manifest.objects[name]
    files: dict[int, DirectFile] = {}
    try:
        for index in needed_files(manifest, [name]):
            files[index] = open_file(dirs, manifest, index, config.direct, backend)
        sk = entry.skeleton.file
        small = read_skeleton(file_path(dirs, manifest, sk), files[sk], manifest, name, verify)
        bases, size, reads = read_plan(entry)
        buf = allocate(manifest_path(dirs), size)
        addr = buf.data_ptr()
        by_file = {f: [ReadRequest(off, n, addr + at, cap, fresh=True) for off, n, at, cap in rs]
                   for f, rs in reads.items()}
        shift = int(buf.storage_offset())  # the buffer is an aligned view into a larger allocation
        offsets = {f"data/{s.key}": base + shift for s, base in zip(entry.storages, bases)}
        archive = skeleton.ArchiveView(small, offsets)

        def rebuild() -> Any:
            return skeleton.rebuild(manifest_path(dirs), archive, buf.untyped_storage(), map_location, weights_only)

        def check(landed: Landed) -> None:
            if verify:
                _verify(dirs, manifest, name, entry, bases, addr, config, landed)

        try:
            return read_then_rebuild(lambda landed: read_files(files, by_file, config, landed), check, rebuild,
                                     lambda: references.rebuild_reads_no_bytes(small["data.pkl"], small, map_location))
        except ReadFailedError as e:  # name what lies where the read failed
            raise _name_failed_read(e, dirs, manifest, name, files) from e
    finally:
        for file in files.values():
            file.close()


def _name_failed_read(e: ReadFailedError, dirs: Sequence[str], manifest: mf.Manifest, name: str,
                      files: dict[int, DirectFile]) -> CheckpointReadError:
    """The read error with the storages whose bytes lie in the failed range."""
    index = next((i for i, f in files.items() if f.path == e.path), None)
    keys = [s.key for s in manifest.objects[name].storages for x in s.extents
            if x.file == index and x.offset < e.offset + e.nbytes and e.offset < x.offset + x.nbytes]
    what = f"object {name!r} storage{'s' if len(keys) > 1 else ''} {', '.join(map(repr, keys[:5]))}" if keys else \
        f"object {name!r}"
    return CheckpointReadError(f"{e} ({what} of checkpoint step {manifest.step})")


def read_files(files: dict[int, DirectFile], by_file: dict[int, list[ReadRequest]], config: IOConfig,
               landed: Landed | None = None) -> None:
    """Read every file's requests, ``config.read_files_at_once`` files at a time (one at a time
    by default: measured faster, see :class:`~fastpersist.config.IOConfig`); raises the first
    real failure (not the stop it caused in another file's reads)."""
    order = sorted(by_file)
    at_once = config.read_files_at_once
    if len(order) <= 1 or at_once == 1:
        for f in order:
            read_into(files[f], by_file[f], config, landed=landed)
        return
    with ThreadPoolExecutor(max_workers=min(len(order), at_once), thread_name_prefix="fastpersist-files") as ex:
        futures = [ex.submit(read_into, files[f], by_file[f], config, None, landed) for f in order]
        wait_futures(futures)
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        raise next((e for e in errors if not isinstance(e, ReadsStopped)), errors[0])


def _verify(dirs: Sequence[str], manifest: mf.Manifest, name: str, entry: mf.ObjectEntry,
            bases: Sequence[int], addr: int, config: IOConfig, landed: Landed) -> None:
    def describe(s: mf.StorageEntry, e: mf.ExtentEntry) -> Callable[[int], str]:
        return lambda got: extent_problem(dirs, manifest, name, s, e, got) or ""

    work = [(addr + base + e.start, e, describe(s, e)) for s, base in zip(entry.storages, bases) for e in s.extents]
    # in the order read_files reads: read_files_at_once files side by side, each from its start
    ends: dict[int, int] = {}
    for _, e, _ in work:
        ends[e.file] = max(ends.get(e.file, 0), e.offset + e.nbytes)
    turn = {f: k // config.read_files_at_once for k, f in enumerate(sorted(ends))}
    work.sort(key=lambda w: turn[w[1].file] + (w[1].offset + w[1].nbytes) / max(1, ends[w[1].file]))
    check_in_memory(work, config.reader_threads, landed)
