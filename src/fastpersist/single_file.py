"""``fastpersist.save`` and ``fastpersist.load``: one torch.load-compatible file, fast.

save: torch's serializer decides what the archive holds, fastpersist lays it out
(:mod:`fastpersist.format.torchzip`, :mod:`fastpersist.format.zipwrite`), the write engine streams
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
from collections.abc import Callable
from typing import Any

import torch

from fastpersist.storage.atomic import check_directory, temp_path_for
from fastpersist.config import IOConfig, get_config
from fastpersist.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from fastpersist.format import integrity, references, skeleton, torchzip
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import BufferPool, align_down, align_up, memory_view, shared_pool
from fastpersist.io.files import DirectFile, file_size, preallocate
from fastpersist.io.reader import Landed, ReadRequest, allocate, read_into, read_then_rebuild
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
    seam (default: real files; see :mod:`fastpersist.storage.faults`).
    """
    with skeleton.collector_paused():  # a full pass of the collector would wait in front of the disk
        _save(obj, os.fspath(path), config or get_config(), backend or FileBackend())


def _save(obj: object, path: str, cfg: IOConfig, files: FileBackend) -> None:
    """:func:`save`; every file operation goes through ``files``."""
    start = time.perf_counter()
    directory = check_directory(path, files)
    pool = shared_pool(cfg.chunk_bytes, cfg.num_buffers)
    from_tensors = cfg.single_file_zero_copy
    if from_tensors is None:  # the pool's first touch would cost more than the copy saves
        from_tensors = not pool.warm
    layout = torchzip.layout(obj, phase_from=cfg.zero_copy_min_bytes, phased=from_tensors)
    laid_out = time.perf_counter() - start  # torch's pickle of obj: before any byte can be written
    temp = temp_path_for(path)
    try:
        file = files.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, cfg.direct, 0)
    except OSError as e:
        raise CheckpointWriteError(f"cannot save {path}: cannot create a file in {directory}: {e.strerror or e}") from e
    try:
        try:
            preallocate(file.fd, layout.file_size)
            digests: dict[Any, int] = dict(write_pieces(file, _pieces(layout), cfg, pool))
            file_direct = file.is_direct  # False if the filesystem refused O_DIRECT on the way
            digests.update(layout.small_digests)
            tail = memoryview(layout.finish_tail(digests))
            files.pwrite(file, tail, layout.body_end)
            files.fsync(file)
        except OSError as e:
            raise CheckpointWriteError(f"cannot save {path}: {e.strerror or e}") from e
        finally:
            file.close()
        try:
            files.replace(temp, path)
        except OSError as e:
            raise CheckpointWriteError(f"cannot publish {path}: {e.strerror or e}") from e
        try:
            files.fsync_dir(directory)
        except OSError as e:  # past the rename: the new file is complete, its name maybe not durable
            raise CheckpointWriteError(
                f"{path} was replaced by the new, complete file, but its directory {directory} could not be "
                f"fsync'd ({e.strerror or e}): after a power loss the name may still show the previous file"
            ) from e
    except BaseException:
        with contextlib.suppress(OSError):  # keep the original error
            if files.exists(temp):
                files.unlink(temp)
        raise
    seconds = time.perf_counter() - start
    logger.debug("saved %s (%d bytes, %s, %s; laid out in %.3f s) in %.3f s", path, layout.file_size,
                 "O_DIRECT" if file_direct else "buffered", "from the tensors" if from_tensors else "staged",
                 laid_out, seconds)
    _keep_warm(pool, from_tensors and cfg.single_file_zero_copy is None)


def _keep_warm(pool: BufferPool, prepare: bool) -> None:
    """Between saves the pool sits idle, maybe for long: its pages are lent to the kernel,
    which takes them only if memory runs short. After a save that found the pool cold, the
    pool is made and faulted in on a thread of its own, so that the next save finds it warm."""
    if prepare:
        pool.prepare_in_background()  # lends the pages once prepared
    else:
        pool.lend_idle()


def _open_for_read(path: str, cfg: IOConfig, backend: FileBackend) -> DirectFile:
    """The file the caller named (a link the caller named is followed; it must end at a regular
    file: a FIFO, device or directory is refused without blocking)."""
    try:
        return backend.open_read(path, cfg.direct, follow=True)
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"no checkpoint at {path}: the file does not exist") from e


def _limit(name: str) -> int:
    if name == "data.pkl":
        return skeleton.MAX_SKELETON_BYTES
    if name == torchzip.CHECKSUM_RECORD:
        return torchzip.MAX_CHECKSUM_RECORD_BYTES
    return torchzip.MAX_SMALL_RECORD_BYTES


def _read_small(path: str, file: DirectFile, records: dict[str, torchzip.Record]) -> dict[str, bytes]:
    """Every record that is not a storage, each bounded by its documented limit."""
    small = {}
    for r in records.values():
        if r.name.startswith("data/"):
            continue
        if r.nbytes > _limit(r.name):
            raise CorruptCheckpointError(f"{path}: record {r.name!r} is {r.nbytes} bytes, more than such a "
                                         f"record may be ({_limit(r.name)}); the file is damaged")
        small[r.name] = file.read_exact(r.offset, r.nbytes)
    return small


def _storage_region(path: str, records: dict[str, torchzip.Record]) -> tuple[torch.Tensor, int, int]:
    """One aligned buffer for the file's bytes from the first storage to the last, the file
    offset its first byte stands for, and the bytes to read."""
    data = [r for r in records.values() if r.name.startswith("data/")]
    base = align_down(min((r.offset for r in data), default=0))
    end = max((r.offset + r.nbytes for r in data), default=base)
    return allocate(path, align_up(end - base)), base, end - base


def load(
    path: PathLike,
    map_location: Any = None,
    *,
    weights_only: bool = True,
    verify: bool | None = None,
    config: IOConfig | None = None,
    backend: FileBackend | None = None,
    progress: Callable[[int], None] | None = None,
) -> Any:
    """Load a file written by :func:`save` (or by ``torch.save``).

    ``map_location`` works as in ``torch.load``. ``weights_only=True`` (the default) uses torch's
    restricted unpickler, which refuses to run arbitrary code; pass ``False`` only for files you
    trust. ``verify`` (default: the configuration's, on) checks every record against the
    checksums fastpersist stored, or, in a file written by plain ``torch.save``, against the
    CRC-32s of its zip directory; a file that carries neither raises
    :class:`UnverifiedCheckpointError` unless ``verify=False``.

    Every failure is a :class:`CheckpointError` naming the file and the cause. ``backend`` is
    the file seam (default: real files). ``progress``, if given, is called with the byte count
    of each completed read of tensor data (from reader threads).
    """
    cfg = config or get_config()
    path = os.fspath(path)
    do_verify = cfg.verify if verify is None else verify
    file = _open_for_read(path, cfg, backend or FileBackend())
    try:
        records = torchzip.read_directory(path, file.read_exact, file_size(file.fd))
        small = _read_small(path, file, records)
        region, base, nbytes = _storage_region(path, records)
        shift = base - int(region.storage_offset())  # file offset -> offset in the region's storage
        record_bytes = _record_bytes(records, small, region, base)

        def read(landed: Landed) -> None:
            read_into(file, [ReadRequest(base, nbytes, region.data_ptr(), region.numel(), fresh=True)], cfg,
                      progress, landed)

        def check(landed: Landed) -> None:
            if not do_verify:
                return

            def landed_bytes(name: str) -> memoryview | bytes:
                if name not in small:
                    landed.wait(region.data_ptr() + records[name].offset - base, records[name].nbytes)
                return record_bytes(name)

            integrity.check(path, records, small, landed_bytes, cfg.reader_threads, in_file_order=True)

        def rebuild() -> Any:
            sizes = {n[len("data/"):]: r.nbytes for n, r in records.items() if n.startswith("data/")}
            problems = references.binding_problems(small["data.pkl"], sizes)
            if problems:
                raise CorruptCheckpointError(f"{path}: {problems[0]}; the file is damaged")
            offsets = {n: r.offset - shift for n, r in records.items() if n.startswith("data/")}
            archive = skeleton.ArchiveView(small, offsets)
            return skeleton.rebuild(path, archive, region.untyped_storage(), map_location, weights_only)

        return read_then_rebuild(read, check, rebuild,
                                 lambda: references.rebuild_reads_no_bytes(small["data.pkl"], small, map_location))
    except OSError as e:
        raise CheckpointReadError(f"reading {path} failed: {e.strerror or e}") from e
    finally:
        file.close()


def _record_bytes(records: dict[str, torchzip.Record], small: dict[str, bytes], region: torch.Tensor,
                  base: int) -> Callable[[str], memoryview | bytes]:
    def get(name: str) -> memoryview | bytes:
        if name in small:
            return small[name]
        r = records[name]
        return memory_view(region.data_ptr() + r.offset - base, r.nbytes)

    return get
