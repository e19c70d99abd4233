"""The skeleton of a state whose structure did not change since the last save, without pickling.

A job that checkpoints every iteration saves the same structure again and again: the same
dicts, lists and tuples, the same tensors (by dtype, shape, strides, offset and which storage
they view), the same strings; only numbers such as a step count, a learning rate or a data
position change. Pickling that structure (torch's format: every tensor reduced by torch's
Python code, a Python hook called for each of its thousands of objects) costs a few
milliseconds of interpreter time per save, which the training thread waits for when the save
runs beside it. A :class:`Templates` cache keeps, per object, the last skeleton as a template:
its pickle cut where each int and float of the structure was written. A later save whose
structure (:func:`_Walk`) equals the template's gets its pickle by writing its own numbers
into the cuts, with no pickling at all.

Why the result is exactly what pickling would give:

* torch pickles with protocol 2: no frames, so bytes are never counted ahead of a cut;
* the pickler memoizes neither ints nor floats (they are atoms, written in place), so a number
  of another length moves no memo index, and a number is written alone (``pickle.dumps(x, 2)``
  without its header and STOP opcode), whatever surrounds it;
* everything else that decides the bytes is part of the structure compared: container types,
  lengths and keys in order, every other value by type and value, and per tensor its type,
  dtype, storage (by first appearance), storage size, device, offset, shape, strides and
  ``requires_grad``; a structure holding anything else (a float or tuple as a key, an object
  of any other type) gets no template and is pickled.

Every template is confirmed when it is made: the save that makes it pickles its state, and the
template filled with that state's numbers must give those very bytes, or it is dropped.
"""

from __future__ import annotations

import pickle
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from fastpersist.format import skeleton

_PROTOCOL = 2  # torch.save's
_BINPERSID = b"Q"

# structure tags (compared by identity, equal to nothing else in a structure)
_DICT, _ODICT, _LIST, _TUPLE, _NUMBER, _KEY_INT, _ALIAS, _ATTRS = (object() for _ in range(8))
_VALUES = frozenset({str, bool, bytes, type(None), torch.dtype, torch.device, torch.Size})
_KEYS = frozenset({bool, type(None)})


class _NotPlain(Exception):
    pass


class _Leaf:
    """Stands in for a number while a template is cut: pickled as a persistent id."""

    __slots__ = ("pid",)

    def __init__(self, pid: int) -> None:
        self.pid = pid


class _Walk:
    """One traversal of a state: its structure, its numbers and its storages, in walk order.
    With ``marked``, also a copy of the state with every number replaced by a :class:`_Leaf`."""

    def __init__(self, obj: Any, marked: bool = False, first_pid: int = 0) -> None:
        self.structure: list[Any] = []
        self.numbers: list[int | float] = []
        self.storages: list[torch.UntypedStorage] = []
        self._index: dict[int, int] = {}
        self._dtypes: dict[int, torch.dtype] = {}  # storage address -> the dtype it is viewed as
        self._seen: dict[int, tuple[int, Any]] = {}  # containers and tensors met: id -> (order, copy)
        self._marked = marked
        self._pid = first_pid
        self.copy = self._node(obj)

    def _node(self, o: Any) -> Any:
        t = type(o)
        add = self.structure.append
        if t is int or t is float:
            add(_NUMBER)
            add(t)
            self.numbers.append(o)
            if self._marked:
                leaf = _Leaf(self._pid + len(self.numbers) - 1)
                return leaf
            return None
        if t is dict or t is OrderedDict or t is list or t is tuple or t is torch.Tensor or t is torch.nn.Parameter:
            # met before: the pickler writes a reference to it (aliasing is structure)
            seen = self._seen.get(id(o))
            if seen is not None:
                add(_ALIAS)
                add(seen[0])
                return seen[1]
            out = self._container(o, t)
            self._seen[id(o)] = (len(self._seen), out)
            return out
        if t in _VALUES:
            add(t)
            add(o)
            return o
        raise _NotPlain

    def _container(self, o: Any, t: type) -> Any:
        add = self.structure.append
        if t is dict or t is OrderedDict:
            add(_DICT if t is dict else _ODICT)
            add(len(o))
            items = []  # the marked copy's (only a marked walk builds copies)
            for k, v in o.items():
                kt = type(k)
                if kt is str:
                    add(k)
                elif kt is int:
                    add(_KEY_INT)
                    add(k)
                elif kt in _KEYS:
                    add(kt)
                    add(k)
                else:
                    raise _NotPlain
                node = self._node(v)
                if self._marked:
                    items.append((k, node))
            attrs = self._node(vars(o)) if t is OrderedDict else None
            if not self._marked:
                return None
            if t is dict:
                return dict(items)
            out: OrderedDict[Any, Any] = OrderedDict(items)
            vars(out).update(attrs or {})
            return out
        if t is list or t is tuple:
            add(_LIST if t is list else _TUPLE)
            add(len(o))
            if not self._marked:
                for v in o:
                    self._node(v)
                return None
            copied = [self._node(v) for v in o]
            return copied if t is list else tuple(copied)
        if t is torch.Tensor or t is torch.nn.Parameter:
            if not skeleton.rebuilds_exactly(o):
                raise _NotPlain
            s = o.untyped_storage()
            ptr = s.data_ptr()
            if ptr and self._dtypes.setdefault(ptr, o.dtype) != o.dtype:
                raise _NotPlain  # memory viewed as two dtypes: pickling refuses it, with its reason
            i = self._index.get(s._cdata)
            if i is None:
                i = self._index[s._cdata] = len(self.storages)
                self.storages.append(s)
            add((t, o.dtype, i, s.nbytes(), s.device, o.storage_offset(), o.shape, o.stride(), o.requires_grad))
            attrs = vars(o)
            if attrs:  # torch.compile's marks: compared as values (a number here is no cut)
                if any(type(v) is float or (type(v) not in _VALUES and type(v) is not int) for v in attrs.values()):
                    raise _NotPlain
                add(_ATTRS)
                add(tuple((k, type(v), v) for k, v in attrs.items()))
            return o
        raise _NotPlain


def _encode(x: int | float) -> bytes:
    return pickle.dumps(x, _PROTOCOL)[2:-1]  # without PROTO 2 and STOP


@dataclass
class _Template:
    structure: list[Any]
    pieces: list[bytes]  # the pickle between the cuts: len(order) + 1 pieces
    order: list[int]  # per cut, in pickle order, the walk index of the number written there
    keys: list[str]  # the storage keys, in torch's order
    storage_order: list[int]  # per key, the walk index of its storage
    tensors: list[Any]  # the object's tensor index (fastpersist.format.manifest.TensorEntry)

    def fill(self, numbers: list[int | float]) -> bytes:
        out = [self.pieces[0]]
        for k, i in enumerate(self.order):
            out.append(_encode(numbers[i]))
            out.append(self.pieces[k + 1])
        return b"".join(out)


@dataclass
class Filled:
    """A skeleton written from a template: what :func:`fastpersist.format.skeleton.serialize`
    would have returned, and the object's tensor index."""

    records: dict[str, bytes]
    keys: list[str]
    storages: list[torch.UntypedStorage]
    tensors: list[Any]


class Templates:
    """The last confirmed template of each object a Checkpointer saves (by object name).

    An object whose structure changes save after save (a growing list of losses) would pay
    for a walk and a template at every save without ever using one: after :data:`GIVE_UP`
    misses in a row its saves are pickled without either, and a template is tried again
    after :data:`RETRY` saves."""

    GIVE_UP = 3
    RETRY = 64

    def __init__(self) -> None:
        self._last: dict[str, _Template] = {}
        self._misses: dict[str, int] = {}  # per object, misses in a row (or saves since giving up)
        self.hits = 0
        self.misses = 0

    def fill(self, name: str, obj: Any) -> tuple[Filled | None, _Walk | None]:
        """The skeleton of ``obj`` from the template of ``name`` if its structure matches
        (else None), and the walk of ``obj`` (None: no template is to be made of it)."""
        missed = self._misses.get(name, 0)
        if missed >= self.GIVE_UP:
            self._misses[name] = missed + 1 if missed < self.GIVE_UP + self.RETRY else 0
            return None, None
        try:
            walk = _Walk(obj)
        except (_NotPlain, RecursionError):  # nested deeper than the walk goes: pickled
            self._last.pop(name, None)
            self._misses[name] = self.GIVE_UP  # nothing to gain until RETRY saves later
            return None, None
        t = self._last.get(name)
        if t is None or t.structure != walk.structure:
            self.misses += 1
            self._misses[name] = missed + 1
            return None, walk
        self.hits += 1
        self._misses[name] = 0
        return Filled(_records(t.fill(walk.numbers)), t.keys,
                      [walk.storages[i] for i in t.storage_order], t.tensors), walk

    def learn(self, name: str, obj: Any, walk: _Walk, records: dict[str, bytes], keys: list[str],
              storages: list[torch.UntypedStorage], tensors: list[Any]) -> bool:
        """Cut a template from ``obj``, just serialized to ``records``; keep it if it gives those
        very bytes back (True)."""
        self._last.pop(name, None)
        by_storage = {s._cdata: i for i, s in enumerate(walk.storages)}
        try:
            storage_order = [by_storage[s._cdata] for s in storages]
        except KeyError:
            return False
        if len(storage_order) != len(walk.storages):
            return False
        first = random.getrandbits(61) | (1 << 62)  # 8-byte LONG1 ids, unlike anything else
        try:
            marked = _Walk(obj, marked=True, first_pid=first)
        except (_NotPlain, RecursionError):
            return False
        data = skeleton.serialize(marked.copy, marks=_Leaf)[0]["data.pkl"]
        found = []
        for i in range(len(walk.numbers)):
            pattern = _encode(first + i) + _BINPERSID
            at = data.find(pattern)
            if at < 0 or data.find(pattern, at + 1) >= 0:
                return False
            found.append((at, len(pattern), i))
        found.sort()
        pieces, pos = [], 0
        for at, n, _ in found:
            pieces.append(data[pos:at])
            pos = at + n
        pieces.append(data[pos:])
        template = _Template(walk.structure, pieces, [i for _, _, i in found], keys, storage_order, tensors)
        if template.fill(walk.numbers) != records["data.pkl"]:
            return False
        self._last[name] = template
        return True


def _records(data_pkl: bytes) -> dict[str, bytes]:
    return {"data.pkl": data_pkl, **skeleton.small_records()}
