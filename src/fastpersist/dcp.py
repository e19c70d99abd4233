"""A storage layer for ``torch.distributed.checkpoint`` (DCP): fastpersist's writes under DCP.

DCP plans a checkpoint of sharded state (FSDP2/DTensor, tensor parallel) and reshards it at
load; its ``FileSystemWriter`` then writes every item with ``torch.save`` through a buffered
Python stream. :class:`Writer` and :class:`Reader` keep DCP's planners and resharding and
replace that storage path:

- every rank writes the items DCP assigned to it as raw bytes, balanced over its roots (one
  file per root, all at once), through fastpersist's pipelined O_DIRECT engine (large CPU
  tensors go out without a copy), hashing each item (xxh3-64);
- every file and directory is fsync'd before ``write_data`` returns on every rank, so the
  coordinator's ``finish`` runs after all data is durable; it writes the metadata last,
  atomically (temporary name, fsync, rename, directory fsync): the commit point;
- :class:`Reader` reads each item's bytes with O_DIRECT, verifies its checksum, and copies
  the requested slice into DCP's destination tensor.

Usage (existing DCP code changes one argument)::

    import torch.distributed.checkpoint as dcp
    from fastpersist.dcp import Reader, Writer
    dcp.save(state_dict, storage_writer=Writer(["/nvme0/ckpt/step-100", "/nvme1/ckpt/step-100"]))
    dcp.load(state_dict, storage_reader=Reader(["/nvme0/ckpt/step-100", "/nvme1/ckpt/step-100"]))

Layout, in each root: ``__<rank>_<root>-<save id>.fpdcp`` data files; in the first root,
``.metadata`` (DCP's ``Metadata``, pickled as DCP does, read back with a restricted unpickler)
whose ``storage_data`` maps every item to an :class:`ItemLocation`. A checkpoint written here
is read by :class:`Reader`, not by DCP's ``FileSystemReader`` (which expects every item in
``torch.save`` format); ``fastpersist.dcp.Reader`` does not read ``FileSystemWriter``
checkpoints either. Saving into a directory that holds a checkpoint replaces it atomically:
the old files stay until the new metadata is committed, then the coordinator removes the ones
on its node that the new metadata does not name.
"""

from __future__ import annotations

import bisect
import dataclasses
import io
import logging
import os
import pickle
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from fastpersist.storage import catalog
from fastpersist import teardown
from fastpersist.config import IOConfig, get_config
from fastpersist.errors import (
    CheckpointNotFoundError,
    CheckpointReadError,
    CheckpointWriteError,
    ChecksumMismatchError,
    CorruptCheckpointError,
)
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import ALIGN, BufferPool, align_up, aligned_empty, memory_view
from fastpersist.io.reader import ReadRequest, read_into
from fastpersist.io.writer import Piece
from fastpersist.objects.read import buffer_areas, merge_spans
from fastpersist.objects.write import files_at_once, place, write_new_file
from fastpersist.loading.view import root_list

logger = logging.getLogger(__name__)

teardown.install()  # gloo's worker threads finish before the interpreter finalizes

METADATA_NAME = ".metadata"
_SUFFIX = ".fpdcp"
_MAX_METADATA = 1 << 30  # bytes: a metadata file larger than this is refused


@dataclass(frozen=True)
class ItemLocation:
    """Where one saved item's bytes are: file (root index and plain name), offset, length,
    xxh3-64 checksum; for a tensor its dtype and the saved chunk's shape."""

    root: int
    name: str
    offset: int
    length: int
    checksum: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class _RankPrefix:
    prefix: str


def _dirs(roots: Sequence[str], checkpoint_id: str | os.PathLike[str] | None) -> list[str]:
    """The checkpoint's directory in every root: ``checkpoint_id`` (when DCP passes one) is
    the first root's; the other roots get a directory of the same name."""
    if checkpoint_id is None:
        return list(roots)
    first = os.path.abspath(os.fspath(checkpoint_id))
    name = os.path.basename(first.rstrip(os.sep))
    return [first] + [os.path.join(r, name) for r in roots[1:]]


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _bytes_of(data: Any) -> tuple[torch.Tensor | bytes, str | None, tuple[int, ...] | None]:
    """An item's bytes: a contiguous uint8 tensor (any device) or bytes; its dtype and shape."""
    if isinstance(data, io.BytesIO):
        return data.getvalue(), None, None
    if isinstance(data, torch.Tensor):
        t = data.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        shape = tuple(t.shape)
        flat = t.reshape(-1)
        return (flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)), str(t.dtype), shape
    raise CheckpointWriteError(f"fastpersist.dcp: cannot write an item of type {type(data).__name__}")


class Writer(StorageWriter):
    """DCP storage writer over fastpersist's O_DIRECT engine; see the module docstring.

    Args:
        roots: the checkpoint's directory, or one per SSD (the same list on every rank). When
            ``dcp.save`` is given a ``checkpoint_id``, it names the first root's directory.
        config: I/O settings (default: the process-wide configuration).
        backend: the file seam (default: real files; see :mod:`fastpersist.storage.faults`).
    """

    def __init__(self, roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 config: IOConfig | None = None, backend: FileBackend | None = None) -> None:
        super().__init__()
        self._roots = root_list(roots)
        self.dirs = list(self._roots)
        self._config = config
        self.backend = backend or FileBackend()
        self.save_id = secrets.token_hex(6)
        self.is_coordinator = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.dirs = _dirs(self._roots, checkpoint_id)
        self.save_id = secrets.token_hex(6)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        for d in self.dirs:
            try:
                self.backend.makedirs(d)
            except OSError as e:
                raise CheckpointWriteError(f"cannot create {d}: {e.strerror or e}") from e
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=_RankPrefix(f"__{i}_")) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix if isinstance(plan.storage_data, _RankPrefix) else f"__{_rank()}_"
        cfg = self._config or get_config()
        buckets = _balance(plan.items, len(self.dirs))
        jobs = [k for k in range(len(self.dirs)) if buckets[k]]

        def one(lane: int, lane_cfg: IOConfig, pool: BufferPool) -> list[WriteResult]:
            k = jobs[lane]
            return self._write_file(k, f"{prefix}{k}-{self.save_id}{_SUFFIX}", buckets[k], planner, lane_cfg, pool)

        results = [r for got in files_at_once(len(jobs), cfg, one) for r in got] if jobs else []
        for d in self.dirs:  # the new files' directory entries are durable too
            self.backend.fsync_dir(d)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write_file(self, k: int, name: str, items: list[WriteItem], planner: SavePlanner, cfg: IOConfig,
                    pool: BufferPool) -> list[WriteResult]:
        path = os.path.join(self.dirs[k], name)
        pieces: list[Piece] = []
        placed: list[tuple[WriteItem, int, int, str | None, tuple[int, ...] | None]] = []
        keep: list[Any] = []  # the bytes stay alive until written
        pos = 0
        for i, item in enumerate(items):
            data, dtype, shape = _bytes_of(planner.resolve_data(item))
            keep.append(data)
            n = len(data) if isinstance(data, bytes) else data.numel()
            on_cpu = isinstance(data, torch.Tensor) and data.device.type == "cpu"
            pos = place(pos, n, data.data_ptr() if on_cpu else None)  # type: ignore[union-attr]
            if isinstance(data, bytes):
                pieces.append(Piece(pos, n, data=data, tag=i))
            elif on_cpu:
                pieces.append(Piece(pos, n, addr=data.data_ptr(), tag=i))
            else:
                pieces.append(Piece(pos, n, tensor=data, tag=i))
            placed.append((item, pos, n, dtype, shape))
            pos += n
        digests = write_new_file(path, pieces, pos, k, self.backend, cfg, pool)
        out = []
        for i, (item, offset, n, dtype, shape) in enumerate(placed):
            digest = digests.get(i, xxhash.xxh3_64_intdigest(b"")) if n else xxhash.xxh3_64_intdigest(b"")
            out.append(WriteResult(index=item.index, size_in_bytes=n,
                                   storage_data=ItemLocation(k, name, offset, n, digest, dtype, shape)))
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rank in results for r in rank}
        # The commit point: the metadata is written last, after every rank's data is durable.
        path = os.path.join(self.dirs[0], METADATA_NAME)
        try:
            catalog.write_atomic(self.dirs[0], METADATA_NAME, pickle.dumps(metadata), self.backend)
        except OSError as e:
            raise CheckpointWriteError(f"cannot commit {path}: {e.strerror or e}") from e
        self._remove_stale(metadata)

    def _remove_stale(self, metadata: Metadata) -> None:
        """Files of earlier saves into the same directories (on this node), best effort."""
        live = {os.path.normpath(os.path.join(self.dirs[loc.root], loc.name))
                for loc in metadata.storage_data.values()}
        for d in self.dirs:
            try:
                names = self.backend.listdir(d)
            except OSError:
                continue
            for n in names:
                p = os.path.normpath(os.path.join(d, n))
                if n.endswith(_SUFFIX) and n.startswith("__") and p not in live:
                    try:
                        self.backend.unlink(p)
                    except OSError as e:
                        logger.warning("could not remove %s: %s", p, e.strerror or e)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _balance(items: Sequence[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items over ``bins`` files, largest first to the least loaded (within a rank)."""
    def size(item: WriteItem) -> int:
        if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
            return 0
        props = item.tensor_data.properties
        numel = 1
        for s in item.tensor_data.size:
            numel *= s
        return numel * torch.empty((), dtype=props.dtype).element_size()

    out: list[list[WriteItem]] = [[] for _ in range(bins)]
    load = [0] * bins
    for n, item in sorted(((size(i), i) for i in items), key=lambda p: p[0], reverse=True):
        k = load.index(min(load))
        out[k].append(item)
        load[k] += n
    return out


# ---------------------------------------------------------------------------------------------
# reading


_ALLOWED_MODULES = ("torch.distributed.checkpoint.", "fastpersist.dcp", "collections")
_ALLOWED_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool", "slice",
                     "complex"}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's Metadata and nothing that could run code (no arbitrary callables)."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and (name in ("Size", "device") or isinstance(
                getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # a layout by its name
            return super().find_class(module, name)
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            raise pickle.UnpicklingError("tensors are not expected in DCP metadata")
        if module.startswith(_ALLOWED_MODULES) or module == "collections":
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing {module}.{name} in checkpoint metadata")


def _read_metadata(directory: str, backend: FileBackend) -> Metadata:
    """The DCP metadata committed in ``directory`` (any DCP writer's), read safely."""
    path = os.path.join(directory, METADATA_NAME)
    try:  # a regular file, not a link, FIFO or device, at most _MAX_METADATA bytes
        raw = backend.read_small(path, _MAX_METADATA, "DCP metadata file")
    except CheckpointNotFoundError as e:
        raise CheckpointNotFoundError(f"no committed fastpersist.dcp checkpoint at {directory} "
                                      f"(no {METADATA_NAME})") from e
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as e:
        raise CorruptCheckpointError(f"{path} is not DCP metadata: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise CorruptCheckpointError(f"{path} is not DCP metadata")
    return metadata


def written_by_fastpersist(directory: str | os.PathLike[str], backend: FileBackend | None = None) -> bool:
    """Whether the DCP checkpoint committed in ``directory`` was written by :class:`Writer`
    (False for another writer's, such as DCP's ``FileSystemWriter``, whose metadata holds
    objects this module's restricted unpickler refuses: read those with DCP's
    ``FileSystemReader``). Raises :class:`CheckpointNotFoundError` when there is none."""
    try:
        metadata = _read_metadata(os.fspath(directory), backend or FileBackend())
    except CorruptCheckpointError:
        return False
    return all(isinstance(v, ItemLocation) for v in metadata.storage_data.values())


class Reader(StorageReader):
    """DCP storage reader for checkpoints written by :class:`Writer`.

    Args:
        roots: as given to the Writer (``checkpoint_id`` works the same way).
        config: I/O settings (default: the process-wide configuration).
        verify: check every item's checksum (default: the configuration's, on).
        backend: the file seam (default: real files).
    """

    def __init__(self, roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 config: IOConfig | None = None, verify: bool | None = None,
                 backend: FileBackend | None = None) -> None:
        super().__init__()
        self._roots = root_list(roots)
        self.dirs = list(self._roots)
        self._config = config
        self._verify = verify
        self.backend = backend or FileBackend()
        self.storage_data: dict[MetadataIndex, ItemLocation] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.dirs = _dirs(self._roots, checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.dirs[0], METADATA_NAME)
        metadata = _read_metadata(self.dirs[0], self.backend)
        bad = [k for k, v in metadata.storage_data.items() if not isinstance(v, ItemLocation)]
        if bad:
            raise CorruptCheckpointError(f"{path} was not written by fastpersist.dcp.Writer (item {bad[0]} has no "
                                         "fastpersist location); read it with DCP's FileSystemReader")
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        cfg = self._config or get_config()
        verify = cfg.verify if self._verify is None else self._verify
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self._path(self._location(item)), []).append(item)
        for path, items in sorted(by_file.items()):
            self._read_file(path, items, planner, cfg, verify)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _location(self, item: ReadItem) -> ItemLocation:
        loc = self.storage_data.get(item.storage_index)
        if loc is None:
            raise CorruptCheckpointError(f"{self.dirs[0]}: the metadata has no location for {item.storage_index.fqn!r}")
        return loc

    def _path(self, loc: ItemLocation) -> str:
        """The data file of ``loc``: a plain name in one of the checkpoint's directories."""
        if not (0 <= loc.root < len(self.dirs)) or os.sep in loc.name or not (
                loc.name.startswith("__") and loc.name.endswith(_SUFFIX)) or ".." in loc.name:
            raise CorruptCheckpointError(f"{self.dirs[0]}: the metadata names file {loc.name!r} on root #{loc.root}, "
                                         f"which is not a data file of this checkpoint ({len(self.dirs)} roots given)")
        return os.path.join(self.dirs[loc.root], loc.name)

    def _read_file(self, path: str, items: list[ReadItem], planner: LoadPlanner, cfg: IOConfig,
                   verify: bool) -> None:
        locs = [self._location(i) for i in items]
        spans = [(start, n) for start, n, _ in merge_spans(sorted({(loc.offset, loc.length) for loc in locs}))]
        end = max(o + n for o, n in spans)
        bases, pos = buffer_areas(spans)
        # Reading a slice of an item (resharding) means other ranks of this node likely read the
        # rest of the same bytes: buffered reads let them share the page cache, where O_DIRECT
        # would read the bytes from the disk once per rank (measured: reshard-load 0.23 GB/s).
        partial = any(list(i.lengths) != list(loc.shape or ()) for i, loc in zip(items, locs)
                      if i.type != LoadItemType.BYTE_IO)
        try:  # a regular file, not a link (never blocks on a FIFO)
            file = self.backend.open_read(path, "off" if partial else cfg.direct)
        except CheckpointNotFoundError as e:
            raise CorruptCheckpointError(f"{path}: a data file of the checkpoint is missing") from e
        try:
            size = os.fstat(file.fd).st_size
            if size < end:
                raise CorruptCheckpointError(f"{path} is truncated: {size} bytes, the metadata needs {end}")
            buf = aligned_empty(align_up(pos + ALIGN), pin=False)
            addr = buf.data_ptr()
            reqs = [ReadRequest(o, n, addr + b, buf.numel() - b, fresh=True) for (o, n), b in zip(spans, bases)]
            read_into(file, reqs, cfg)
        finally:
            file.close()
        starts = [o for o, _ in spans]

        def at(offset: int) -> int:  # buffer position of file byte ``offset``
            k = bisect.bisect_right(starts, offset) - 1
            return bases[k] + offset - spans[k][0]

        for item, loc in zip(items, locs):
            raw = memory_view(addr + at(loc.offset), loc.length)
            if verify and xxhash.xxh3_64_intdigest(raw) != loc.checksum:
                raise ChecksumMismatchError(f"{path}: item {item.storage_index.fqn!r} (bytes {loc.offset}.."
                                            f"{loc.offset + loc.length}) fails its checksum; the checkpoint is corrupt")
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(raw)))
                continue
            self._load_tensor(path, item, loc, buf[at(loc.offset): at(loc.offset) + loc.length], planner)

    def _load_tensor(self, path: str, item: ReadItem, loc: ItemLocation, raw: torch.Tensor,
                     planner: LoadPlanner) -> None:
        if loc.dtype is None or loc.shape is None:
            raise CorruptCheckpointError(f"{path}: item {item.storage_index.fqn!r} has no dtype or shape")
        dtype = getattr(torch, loc.dtype.replace("torch.", ""), None)
        if not isinstance(dtype, torch.dtype):
            raise CorruptCheckpointError(f"{path}: item {item.storage_index.fqn!r} has an unknown dtype {loc.dtype!r}")
        numel = 1
        for s in loc.shape:
            numel *= s
        if numel * torch.empty((), dtype=dtype).element_size() != loc.length:
            raise CorruptCheckpointError(f"{path}: item {item.storage_index.fqn!r}: {loc.length} bytes do not hold "
                                         f"a {dtype} tensor of shape {list(loc.shape)}")
        src = raw.view(dtype).reshape(loc.shape) if numel else torch.empty(loc.shape, dtype=dtype)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            src = src.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != src.size():
            raise CheckpointReadError(f"{path}: item {item.storage_index.fqn!r}: the saved slice has shape "
                                      f"{list(src.size())}, the destination {list(target.size())}")
        target.copy_(src)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))
