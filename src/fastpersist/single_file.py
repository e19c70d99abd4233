"""``fastpersist.save`` and ``fastpersist.load``: one torch.load-compatible file, fast.

save: torch lays out the archive (:mod:`fastpersist.format.torchzip`), the write engine streams
it to a temporary file with O_DIRECT, hashing every storage on the way; the checksum record and
the zip directory go last; the file is fsync'd and renamed over the final name.

load: the zip directory is parsed, the byte range holding the storages is read with O_DIRECT in
parallel into one page-aligned host buffer, checksums are verified, and torch's own unpickler
rebuilds the object with storages that are slices of that buffer (no copy). With
``weights_only=True`` (the default, as in torch.load) torch's restricted unpickler is used.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import xxhash

from fastpersist.commit import check_directory, temp_path_for
from fastpersist.config import IOConfig, get_config
from fastpersist.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ChecksumMismatchError,
)
from fastpersist.format import skeleton, torchzip
from fastpersist.io.backend import FileBackend
from fastpersist.io.buffers import aligned_empty, align_down, align_up, memory_view, shared_pool
from fastpersist.io.files import DirectFile, pread_into, preallocate, pwrite_all
from fastpersist.io.reader import ReadRequest, read_into
from fastpersist.io.writer import Piece, write_pieces

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike[str]


def _pieces(layout: torchzip.Layout) -> list[Piece]:
    pieces = [Piece(off, len(b), data=b) for off, b in layout.chunks]
    for s in layout.storages:
        if s.nbytes:
            pieces.append(Piece(s.offset, s.nbytes, tensor=torchzip.byte_view(s.storage), tag=s.name))
    return pieces


def save(obj: object, path: PathLike, *, config: IOConfig | None = None, backend: FileBackend | None = None) -> None:
    """Save ``obj`` to ``path`` as a torch.load-compatible file.

    Accepts everything ``torch.save`` accepts. The file appears under ``path`` only when it is
    complete and durable; an existing file of that name is replaced atomically, and is left
    untouched if the save fails before the rename (no temporary file is left either); a failure
    to fsync the directory after the rename says so. ``backend`` is the file
    seam (default: real files; see :mod:`fastpersist.faults`).
    """
    cfg = config or get_config()
    io = backend or FileBackend()
    path = os.fspath(path)
    start = time.perf_counter()
    directory = check_directory(path)
    layout = torchzip.layout(obj)
    temp = temp_path_for(path)
    try:
        file = io.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, cfg.direct, 0)
    except OSError as e:
        raise CheckpointWriteError(f"cannot save {path}: cannot create a file in {directory}: {e.strerror or e}") from e
    try:
        try:
            preallocate(file.fd, layout.file_size)
            pool = shared_pool(cfg.chunk_bytes, cfg.num_buffers)
            digests: dict[Any, int] = dict(write_pieces(file, _pieces(layout), cfg, pool))
            file_direct = file.is_direct  # False if the filesystem refused O_DIRECT on the way
            digests.update(layout.small_digests)
            tail = memoryview(layout.finish_tail(digests))
            if file.on_write is not None:
                file.on_write(layout.body_end, len(tail))
            pwrite_all(file.fd, tail, layout.body_end)
            io.fsync(file)
        except OSError as e:
            raise CheckpointWriteError(f"cannot save {path}: {e.strerror or e}") from e
        finally:
            file.close()
        try:
            io.replace(temp, path)
        except OSError as e:
            raise CheckpointWriteError(f"cannot publish {path}: {e.strerror or e}") from e
        try:
            io.fsync_dir(directory)
        except OSError as e:  # past the rename: the new file is complete, its name maybe not durable
            raise CheckpointWriteError(
                f"{path} was replaced by the new, complete file, but its directory {directory} could not be "
                f"fsync'd ({e.strerror or e}): after a power loss the name may still show the previous file"
            ) from e
    except BaseException:
        with contextlib.suppress(OSError):  # keep the original error
            if os.path.lexists(temp):
                io.unlink(temp)
        raise
    seconds = time.perf_counter() - start
    logger.debug("saved %s (%d bytes, %s) in %.3f s", path, layout.file_size,
                 "O_DIRECT" if file_direct else "buffered", seconds)


def _open_for_read(path: str, cfg: IOConfig) -> DirectFile:
    try:
        return DirectFile(path, os.O_RDONLY, cfg.direct)
    except FileNotFoundError as e:
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the file does not exist") from e
    except IsADirectoryError as e:
        raise CheckpointReadError(f"{path} is a directory, not a checkpoint file") from e
    except OSError as e:
        raise CheckpointReadError(f"cannot open {path}: {e.strerror or e}") from e


def _read_small(file: DirectFile, records: dict[str, torchzip.Record]) -> dict[str, bytes]:
    small = {}
    for r in records.values():
        if not r.name.startswith("data/"):
            buf = bytearray(r.nbytes)
            pread_into(file.fd, memoryview(buf), r.offset)
            small[r.name] = bytes(buf)
    return small


def _verify(path: str, records: dict[str, torchzip.Record], small: dict[str, bytes],
            region: torch.Tensor, base: int, expected: dict[str, int], threads: int) -> None:
    def digest(name: str) -> int:
        if name in small:
            return xxhash.xxh3_64_intdigest(small[name])
        r = records[name]
        return xxhash.xxh3_64_intdigest(memory_view(region.data_ptr() + r.offset - base, r.nbytes))

    missing = [n for n in expected if n not in records]
    if missing:
        raise ChecksumMismatchError(f"{path}: records {missing} are listed in its checksums but missing")
    names = sorted(expected, key=lambda n: -records[n].nbytes)
    with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastpersist-verify") as ex:
        got = dict(zip(names, ex.map(digest, names)))
    for n in sorted(expected):
        if got[n] != expected[n]:
            r = records[n]
            raise ChecksumMismatchError(
                f"{path}: record {n!r} ({r.nbytes} bytes at offset {r.offset}) fails its checksum "
                f"(stored {expected[n]:016x}, read {got[n]:016x}); the file is corrupt"
            )


def load(
    path: PathLike,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    verify: bool | None = None,
    config: IOConfig | None = None,
) -> Any:
    """Load a file written by :func:`save` (or by ``torch.save``).

    ``map_location`` works as in ``torch.load``. ``weights_only=True`` (the default) uses torch's
    restricted unpickler, which refuses to run arbitrary code; pass ``False`` only for files you
    trust. ``verify`` (default: the configuration's, on) checks every record against the
    checksums fastpersist stored; files written by plain torch.save carry none and are read
    unverified.
    """
    cfg = config or get_config()
    path = os.fspath(path)
    do_verify = cfg.verify if verify is None else verify
    file = _open_for_read(path, cfg)
    try:
        size = os.fstat(file.fd).st_size
        records = torchzip.read_directory(path, file.fd, size)
        small = _read_small(file, records)
        data = [r for r in records.values() if r.name.startswith("data/")]
        base = align_down(min((r.offset for r in data), default=0))
        end = max((r.offset + r.nbytes for r in data), default=base)
        region = aligned_empty(align_up(end - base), pin=False)
        read_into(file, [ReadRequest(base, end - base, region.data_ptr(), region.numel(), fresh=True)], cfg)
    finally:
        file.close()
    if do_verify and torchzip.CHECKSUM_RECORD in small:
        expected = torchzip.parse_checksums(path, small[torchzip.CHECKSUM_RECORD])
        _verify(path, records, small, region, base, expected, cfg.reader_threads)
    shift = base - region.storage_offset()  # file offset -> offset in the region's storage
    offsets = {n: r.offset - shift for n, r in records.items() if n.startswith("data/")}
    archive = skeleton.ArchiveView(small, offsets)
    return skeleton.rebuild(path, archive, region.untyped_storage(), map_location, weights_only)
