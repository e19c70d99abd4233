"""Sharded tensors (DTensors) in a state: taken out at save, placed back at load.

A state may hold DTensors (FSDP2 parameters and optimizer state, tensor-parallel shards, 2-D
meshes). At save, :func:`split` takes every DTensor reachable through dicts, lists and tuples
out of the state (the state keeps ``None`` in its place, and the rest is saved as replicated
state as before) and records, per DTensor, this rank's chunk: the box of the global tensor its
local tensor holds. The ranks exchange those records, and :func:`assign` decides, identically
on every rank, who writes which bytes:

* every distinct chunk is written once, however many ranks hold it (a shard replicated over a
  mesh dimension is never written once per replica);
* a chunk held by several ranks (its replica group) is split over them in 4 KiB-aligned parts,
  so they share the write (FastPersist's second technique); small chunks go whole to the
  least-loaded holder.

At load, :func:`get_path` and :func:`put_paths` find and set values by key path.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fastpersist.errors import CheckpointReadError, CheckpointWriteError, UnsaveableObjectError
from fastpersist.format import manifest as mf
from fastpersist.plan import ALIGN, cuts

Path = tuple[str | int, ...]
# A chunk at least this large held by several ranks is split over them; a smaller one goes whole
# to one of them.
SPLIT_MIN = 1 << 20


@dataclass(frozen=True)
class ChunkMeta:
    """What a rank says about one DTensor it holds (the same on every rank of its replica group)."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = mf.DTYPE_SIZES[self.dtype]
        for d in self.sizes:
            n *= d
        return n

    @property
    def key(self) -> str:
        return mf.key_name(self.path)


@dataclass
class LocalShard:
    meta: ChunkMeta
    tensor: torch.Tensor  # the local data, contiguous, of shape meta.sizes (may be empty)


@dataclass(frozen=True)
class Piece:
    """Bytes ``[start, start + nbytes)`` of distinct chunk ``chunk``, written by ``rank``."""

    chunk: int
    start: int
    nbytes: int
    rank: int


def dtensor_type() -> type | None:
    """torch's DTensor class, if its module is loaded: no DTensor exists before it is (its
    import costs most of a second, which a state without DTensors should not pay)."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def is_dtensor(value: object) -> bool:
    t = dtensor_type()
    return t is not None and isinstance(value, t)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor, else ``t``."""
    return t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]


def dtype_name(dtype: torch.dtype, where: str) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in mf.DTYPE_SIZES:
        raise UnsaveableObjectError(f"{where}: a sharded tensor of dtype {dtype} cannot be saved")
    return name


def chunk_of(value: Any, path: Path) -> LocalShard:
    """This rank's chunk of DTensor ``value``."""
    key = mf.key_name(path)
    if any(p.is_partial() for p in value.placements):
        raise UnsaveableObjectError(
            f"state[{key!r}] is a DTensor with a Partial placement {tuple(value.placements)}: its local values are "
            "pending a reduction, so no rank holds the tensor's values; redistribute it to Shard/Replicate first")
    chunks = value.__create_chunk_list__()
    tensor = value.to_local()
    if len(chunks) != 1:
        raise UnsaveableObjectError(f"state[{key!r}]: a DTensor whose local tensor holds {len(chunks)} chunks "
                                    "cannot be saved")
    offsets, sizes = tuple(int(x) for x in chunks[0].offsets), tuple(int(x) for x in chunks[0].sizes)
    if tuple(tensor.shape) != sizes:
        raise UnsaveableObjectError(f"state[{key!r}]: the DTensor's local tensor has shape {tuple(tensor.shape)}, "
                                    f"its placement says {sizes}")
    meta = ChunkMeta(path, dtype_name(value.dtype, f"state[{key!r}]"), tuple(int(x) for x in value.shape),
                     offsets, sizes)
    # raw bytes are written: a lazy conjugate or negative view is resolved first (a copy)
    tensor = tensor.resolve_conj().resolve_neg()
    return LocalShard(meta, tensor if tensor.is_contiguous() else tensor.contiguous())


def split(obj: Any, path: Path = ()) -> tuple[Any, list[LocalShard]]:
    """``obj`` with every DTensor replaced by ``None``, and this rank's chunk of each.

    Containers are rebuilt only where they hold a DTensor, so everything else keeps its type.
    """
    shards: list[LocalShard] = []
    out = _split(obj, path, shards)
    return out, shards


def _split(obj: Any, path: tuple[Any, ...], shards: list[LocalShard]) -> Any:
    """One walk: ``path`` holds the raw keys, checked only where a DTensor is found."""
    if isinstance(obj, torch.Tensor):
        if is_dtensor(obj):
            if not path:
                raise UnsaveableObjectError("the state itself is a DTensor: put it in a dict")
            shards.append(chunk_of(obj, _key_path(path)))
            return None
        return obj
    if isinstance(obj, Mapping):
        found = len(shards)
        items = [(k, _split(v, path + (k,), shards)) for k, v in obj.items()]
        if len(shards) == found:
            return obj
        if isinstance(obj, OrderedDict):  # a module's state_dict: its _metadata kept
            out: dict[Any, Any] = OrderedDict(items)
            vars(out).update(vars(obj))
            return out
        return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        if _holds_dtensor(tuple(obj)):
            raise UnsaveableObjectError(f"state[{mf.key_name(_key_path(path))!r}] is a {type(obj).__name__} (a "
                                        "namedtuple) holding DTensors: put sharded tensors in dicts, lists or tuples")
        return obj
    if isinstance(obj, (list, tuple)):
        found = len(shards)
        values = [_split(v, path + (i,), shards) for i, v in enumerate(obj)]
        if len(shards) == found:
            return obj
        return tuple(values) if isinstance(obj, tuple) else values
    return obj


def _holds_dtensor(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return is_dtensor(obj)
    if isinstance(obj, Mapping):
        return any(_holds_dtensor(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):  # namedtuples too: split() refuses them by name
        return any(_holds_dtensor(v) for v in obj)
    return False


def _key_path(raw: tuple[Any, ...]) -> Path:
    """The key path of a DTensor: every key a str or an int (they are stored in JSON)."""
    for i, key in enumerate(raw):
        if not (isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool))):
            raise UnsaveableObjectError(
                f"state[{mf.key_name(tuple(map(str, raw[:i])))!r}] holds DTensors under a key of type "
                f"{type(key).__name__} ({key!r}): sharded tensors need str or int keys")
    return raw


def holds_dtensors(obj: Any) -> bool:
    return dtensor_type() is not None and _holds_dtensor(obj)


def tensor_index(obj: Any, keys: Sequence[str], storages: Sequence[torch.UntypedStorage]) -> list[mf.TensorEntry]:
    """Every plain tensor reachable from ``obj`` through dicts (str or int keys), lists and
    tuples, by key path, as a view of one of the serialized storages."""
    by_storage = {s._cdata: k for k, s in zip(keys, storages)}
    out: list[mf.TensorEntry] = []
    seen: set[Path] = set()

    def walk(o: Any, path: Path) -> None:
        if isinstance(o, torch.Tensor):
            key = by_storage.get(o.untyped_storage()._cdata)
            name = str(o.dtype).removeprefix("torch.")
            plain = o.layout == torch.strided and not o.is_conj() and not o.is_neg()  # raw bytes = values
            if path and key is not None and name in mf.DTYPE_SIZES and path not in seen and plain:
                seen.add(path)
                out.append(mf.TensorEntry(path, name, tuple(o.shape), tuple(o.stride()), key, int(o.storage_offset())))
        elif isinstance(o, Mapping):
            for k, v in o.items():
                if isinstance(k, str) or (isinstance(k, int) and not isinstance(k, bool)):
                    walk(v, path + (k,))
        elif isinstance(o, (list, tuple)):
            for i, v in enumerate(o):
                walk(v, path + (i,))

    walk(obj, ())
    return out


@dataclass(frozen=True)
class Layout:
    """Every sharded tensor (path, dtype, global shape), its distinct chunks and who writes what."""

    tensors: list[tuple[Path, str, tuple[int, ...]]]
    chunks: list[ChunkMeta]
    pieces: list[Piece]
    holders: list[list[int]]  # per chunk, the ranks that hold it


def assign(per_rank: Sequence[Sequence[ChunkMeta]]) -> Layout:
    """The distinct chunks (in a fixed order) and who writes which of their bytes.

    Raises :class:`CheckpointWriteError` if the ranks disagree on a tensor's dtype or global
    shape, or if the chunks do not tile a tensor exactly.
    """
    chunks: list[ChunkMeta] = []
    holders: list[list[int]] = []
    index: dict[tuple[Path, tuple[int, ...], tuple[int, ...]], int] = {}
    tensors: dict[Path, tuple[str, tuple[int, ...], int]] = {}
    for rank, metas in enumerate(per_rank):
        for m in metas:
            seen = tensors.setdefault(m.path, (m.dtype, m.shape, rank))
            if seen[:2] != (m.dtype, m.shape):
                raise CheckpointWriteError(
                    f"sharded tensor {m.key!r}: rank {seen[2]} holds it as {seen[0]} of global shape {list(seen[1])}, "
                    f"rank {rank} as {m.dtype} of shape {list(m.shape)}; every rank must save the same tensors")
            if not m.nbytes:
                continue
            at = index.get((m.path, m.offsets, m.sizes))
            if at is None:
                at = index[(m.path, m.offsets, m.sizes)] = len(chunks)
                chunks.append(m)
                holders.append([])
            holders[at].append(rank)
    _check_tiling(chunks, tensors)
    loads = [0] * len(per_rank)
    pieces: list[Piece] = []
    for c, (m, hs) in enumerate(zip(chunks, holders)):
        n = m.nbytes
        if len(hs) > 1 and n >= SPLIT_MIN:
            bounds = cuts([n], len(hs), ALIGN)
            for k, r in enumerate(hs):
                if bounds[k + 1] > bounds[k]:
                    pieces.append(Piece(c, bounds[k], bounds[k + 1] - bounds[k], r))
                    loads[r] += bounds[k + 1] - bounds[k]
        else:
            r = min(hs, key=lambda r: (loads[r], r))
            pieces.append(Piece(c, 0, n, r))
            loads[r] += n
    return Layout([(p, d, shape) for p, (d, shape, _) in tensors.items()], chunks, pieces, holders)


def _check_tiling(chunks: Sequence[ChunkMeta], tensors: Mapping[Path, tuple[str, tuple[int, ...], int]]) -> None:
    boxes: dict[Path, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {p: [] for p in tensors}
    for m in chunks:
        boxes[m.path].append((m.offsets, m.sizes))
    for p, (_, shape, _) in tensors.items():
        problem = mf.tiling_problem(shape, boxes[p])
        if problem:
            raise CheckpointWriteError(
                f"sharded tensor {mf.key_name(p)!r} of global shape {list(shape)}: {problem}; the placements of "
                "its DTensors on the ranks do not partition it")


# ---------------------------------------------------------------------------------------------
# by key path, at load

def get_path(obj: Any, path: Path) -> Any:
    """The value at ``path`` in ``obj`` (dicts by key, lists and tuples by index), or None."""
    for part in path:
        try:
            if isinstance(obj, Mapping) or (isinstance(obj, (list, tuple)) and isinstance(part, int)):
                obj = obj[part]  # type: ignore[index]
            else:
                return None
        except (KeyError, IndexError):
            return None
    return obj


def put_paths(obj: Any, values: Mapping[Path, Any], where: str) -> Any:
    """``obj`` with the value at each path replaced (dicts and lists in place, tuples rebuilt)."""
    out = obj
    for path, value in values.items():
        out = _put(out, path, value, where)
    return out


def _put(obj: Any, path: Path, value: Any, where: str) -> Any:
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, dict):
        obj[head] = _put(obj.get(head), rest, value, where)
        return obj
    if isinstance(obj, list) and isinstance(head, int) and head < len(obj):
        obj[head] = _put(obj[head], rest, value, where)
        return obj
    if isinstance(obj, tuple) and isinstance(head, int) and head < len(obj):
        return tuple(_put(v, rest, value, where) if i == head else v for i, v in enumerate(obj))
    raise CheckpointReadError(f"{where}: the state has no place for sharded tensor {mf.key_name(path)!r}")
