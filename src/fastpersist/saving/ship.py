"""A captured save as a small message: what crosses from the training process to its save process.

``save()`` copies the state's storages into the shared snapshot arena (:class:`fastpersist.saving.arena.Arena`
with ``shared=True``). What the save process needs besides those bytes is small: the state's
structure (containers, immutable values, each tensor's dtype, shape, strides and offset), the
skeletons ``save()`` pickled for states that are not plain, the DTensors' shard metadata, and the
save's arguments. :func:`encode` pickles exactly that, each storage replaced by its range of the
arena (``("a", offset, nbytes)``) or of a region of tensors moved into shared memory (overlap mode,
:mod:`fastpersist.saving.sharing`), so the message is kilobytes whatever the state's size;
:func:`decode` rebuilds it over the save process's own mapping of the same memory, where the
tensors are views of the bytes ``save()`` copied. No tensor byte is copied between the processes.

The message comes from the save process's own parent over a private socket; it holds only
fastpersist's own types, torch's, and the immutable values a state held (a class the save process
cannot import fails that save, naming it).
"""

from __future__ import annotations

import io
import pickle
import threading
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fastpersist.errors import CheckpointError
from fastpersist.format.skeleton import rebuilds_exactly
from fastpersist.io.buffers import ALIGN, align_up
from fastpersist.objects.dtensor import LocalShard, is_dtensor
from fastpersist.objects.write import Prepared


@dataclass
class Shipped:
    """One captured save (see the module)."""

    step: int
    state: Any  # captured: tensors are views of the arena (None when ``prepared`` holds it pickled)
    rank_state: Any
    shards: list[LocalShard] = field(default_factory=list)
    prepared: tuple[Prepared, Prepared | None] | None = None
    metadata: Mapping[str, Any] | None = None
    directory: str | None = None


class _Memory(threading.local):
    """The shared memory the message being decoded names (set by :func:`decode`, per thread),
    and the storages rebuilt so far: one storage per range, so tensors that shared a storage in
    the training process share one here (the checkpoint keeps them aliased)."""

    storages: Mapping[Any, torch.UntypedStorage] = {}
    made: dict[tuple[Any, ...], torch.UntypedStorage] = {}


_decoding = _Memory()


def _storage(ref: tuple[Any, ...]) -> torch.UntypedStorage:
    """The storage a message names: ``("e",)`` an empty one, ``(name, offset, nbytes)`` a
    range of the shared memory ``name``."""
    if ref[0] == "e":
        return torch.UntypedStorage(0)
    made = _decoding.made.get(ref)
    if made is not None:
        return made
    name, offset, n = ref
    storage = _decoding.storages.get(name)
    if storage is None:
        raise CheckpointError(f"a shipped save names shared memory {name!r}, which this process has not mapped")
    if offset + n > storage.nbytes():
        raise CheckpointError(f"a shipped save names bytes {offset}-{offset + n} past shared memory {name!r}'s "
                              f"{storage.nbytes()}")
    made = _decoding.made[ref] = storage[offset : offset + n]
    return made


def _tensor(ref: tuple[Any, ...], offset: int, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype,
            requires_grad: bool, parameter: bool, attrs: dict[str, Any] | None) -> torch.Tensor:
    """A tensor over the storage ``ref`` names, as the training process captured it."""
    t = torch.empty(0, dtype=dtype).set_(_storage(ref), offset, size, stride)
    if parameter:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    if attrs:
        vars(t).update(attrs)
    return t


class NotPlain(Exception):
    """The state holds a value the save process might not rebuild (an object of a class of the
    training script's own, a tensor subclass): the state is pickled in ``save()`` instead."""


class HoldsDTensors(Exception):
    """The state holds DTensors: their local shards are taken out first (``dtensor.split``)."""


# types the save process rebuilds from their module (torch's, the standard library's, fastpersist's)
_IMPORTABLE_ROOTS = ("torch", "collections", "fastpersist", "builtins", "numpy", "enum", "copyreg")


class Encoder(pickle.Pickler):
    """Pickles a captured save in one pass over the state; every storage becomes the range of
    shared memory holding it: a region of moved tensors (``live``: storage address -> its
    region's name and base address), or the snapshot arena, where it is placed at the next free
    aligned offset as the pass meets it (:attr:`pending` lists what to copy there, in order,
    :attr:`pos` the arena bytes needed). With ``strict``, a value the save process might not
    rebuild raises :class:`NotPlain`.

    Storages are met through :meth:`reducer_override` (called only for objects that are not of
    the built-in container and scalar types), not ``persistent_id`` (called for every object).
    """

    def __init__(self, file: io.BytesIO, live: Mapping[int, tuple[Any, int]], strict: bool) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.live = live
        self.strict = strict
        self.refs: dict[int, tuple[Any, ...]] = {}
        self.pending: list[tuple[int, torch.UntypedStorage]] = []
        self.pos = 0
        self.live_used = False

    def ref(self, storage: torch.UntypedStorage) -> tuple[Any, ...]:
        key = storage.data_ptr()
        found = self.refs.get(key)
        if found is not None:
            return found
        n = storage.nbytes()
        if n == 0:
            return ("e",)
        where = self.live.get(key)  # host addresses (device memory has addresses of its own)
        if where is not None:
            name, base = where
            self.live_used = True
            ref: tuple[Any, ...] = (name, key - base, n)
        else:
            ref = ("a", self.pos, n)
            self.pending.append((self.pos, storage))
            self.pos += align_up(n, ALIGN)
        self.refs[key] = ref
        return ref

    def reducer_override(self, obj: Any) -> Any:
        t = type(obj)
        if t is torch.Tensor or t is torch.nn.Parameter:
            if not rebuilds_exactly(obj):
                raise NotPlain(f"a tensor that is not its storage's bytes ({obj.layout}, quantized or a lazy view)")
            return _tensor, (self.ref(obj.untyped_storage()), obj.storage_offset(), tuple(obj.size()), obj.stride(),
                             obj.dtype, obj.requires_grad, t is torch.nn.Parameter, obj.__dict__ or None)
        if t is torch.UntypedStorage:
            return _storage, (self.ref(obj),)
        if self.strict:
            if isinstance(obj, torch.Tensor):
                if is_dtensor(obj):
                    raise HoldsDTensors()
                raise NotPlain(f"a {t.__qualname__} (a tensor subclass)")
            named = isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType))  # pickled by name
            owner = (getattr(obj, "__module__", None) or "") if named else t.__module__
            if owner.partition(".")[0] not in _IMPORTABLE_ROOTS or "<locals>" in getattr(obj, "__qualname__", ""):
                raise NotPlain(f"a {owner}.{getattr(obj, '__qualname__', t.__qualname__)}")
        return NotImplemented


def encode(shipped: Shipped, live: Mapping[int, tuple[Any, int]], strict: bool) -> Encoder:
    """``shipped`` pickled by an :class:`Encoder` (its bytes: ``encoder.message``)."""
    out = io.BytesIO()
    encoder = Encoder(out, live, strict)
    encoder.dump(shipped)
    encoder.message = out.getvalue()  # type: ignore[attr-defined]
    return encoder


def decode(message: bytes, memory: Mapping[Any, torch.Tensor]) -> Shipped:
    """The save :func:`encode` shipped, its tensors views of this process's mappings of ``memory``."""
    _decoding.storages = {name: t.untyped_storage() for name, t in memory.items()}
    _decoding.made = {}
    try:
        shipped = pickle.loads(message)
    except (AttributeError, ImportError) as e:  # a type the state held that this process cannot import
        raise CheckpointError(f"the save process cannot rebuild the captured state: {e}; a state's values must be "
                              "importable by module name (not defined in __main__) with engine='process'") from e
    finally:
        _decoding.storages, _decoding.made = {}, {}
    if not isinstance(shipped, Shipped):
        raise CheckpointError(f"internal: a shipped save is a {type(shipped).__name__}")
    return shipped
