"""The storages a torch pickle refers to, found without running the pickle. Pure: no I/O.

torch's pickle names every storage by a *persistent id* ``("storage", StorageType, key,
location, numel)``. :func:`references` reads those ids with an unpickler that builds nothing:
every global it meets becomes an inert stand-in (except torch's storage classes, whose dtype it
needs), so no code of the checkpoint runs, whatever the pickle holds, and memory stays
proportional to the pickle's size.

:func:`binding_problems` then checks the *binding* between the skeleton and the storages
the checkpoint holds: every referenced key must exist and have exactly ``numel x element
size`` bytes, and every stored storage must be referenced. Load and verify both run it, so
a storage key the skeleton does not know, a storage of the wrong size, or a skeleton that
points at storages the checkpoint lacks is caught by both, before any tensor is built.
"""

from __future__ import annotations

import io
import pickle
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Reference:
    key: str
    nbytes: int  # numel x element size, as torch's loader will slice it
    itemsize: int = 1


class _Inert:
    """Whatever the pickle builds: accepts every call and every mutation, does nothing."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __call__(self, *_args: Any, **_kwargs: Any) -> _Inert:
        return _Inert()

    def __setstate__(self, _state: Any) -> None:
        pass

    def __setitem__(self, _key: Any, _value: Any) -> None:
        pass

    def append(self, _value: Any) -> None:
        pass

    def extend(self, _values: Any) -> None:
        pass


class _Problem(Exception):
    pass


class _StorageType(_Inert):
    """Stands for one of torch's storage classes (never the class itself: calling it would
    allocate)."""

    def __init__(self, itemsize: int) -> None:
        self.itemsize = itemsize


def _itemsizes() -> dict[str, int]:
    """Element size of each of torch's storage classes, by name (``FloatStorage``: 4)."""
    out = {"UntypedStorage": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation notice
        for name in dir(torch):
            cls = getattr(torch, name, None)
            dtype = getattr(cls, "dtype", None) if name.endswith("Storage") and isinstance(cls, type) else None
            if isinstance(dtype, torch.dtype):
                out[name] = dtype.itemsize
    return out


_ITEMSIZES = _itemsizes()


def _storage_type(module: str, name: str) -> _StorageType | None:
    if module not in ("torch", "torch.storage") or name not in _ITEMSIZES:
        return None
    return _StorageType(_ITEMSIZES[name])


class _StorageRef(_Inert):
    """What a persistent id unpickles to here: the storage's key and size."""

    def __init__(self, ref: Reference) -> None:
        self.ref = ref


def _view_problem(storage: Any, offset: Any, size: Any, stride: Any) -> str | None:
    """What is wrong with a tensor view of ``storage`` (None if it lies inside it)."""
    if not isinstance(storage, _StorageRef):
        return None
    key = storage.ref.key
    if type(size) is not tuple or type(stride) is not tuple or len(size) != len(stride) or type(offset) is not int:
        return f"a tensor of storage {key!r} has a malformed shape"
    last = offset
    empty = False
    for n, st in zip(size, stride):
        if type(n) is not int or type(st) is not int or n < 0 or st < 0:
            return f"a tensor of storage {key!r} has a malformed or negative size or stride"
        empty = empty or n == 0
        last += (n - 1) * st
    if offset < 0:
        return f"a tensor of storage {key!r} has a negative offset"
    itemsize = storage.ref.itemsize
    if not empty and (last + 1) * itemsize > storage.ref.nbytes:
        return (f"a tensor view of storage {key!r} reaches element {last}, beyond the storage's "
                f"{storage.ref.nbytes // max(1, itemsize)} elements")
    return None


# Globals whose rebuild reads no byte of a tensor's storage, whatever their arguments: tensors and
# parameters as views of their storages, and containers that only hold what they are given.
# (Not torch.device, torch.Size, complex or bytearray: given a tensor, each reads its values.)
_BYTE_FREE = {
    ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"), ("collections", "OrderedDict"),
    *((b, n) for b in ("builtins", "__builtin__") for n in ("set", "frozenset", "slice")),
}


def _byte_free(module: str, name: str) -> bool:
    if (module, name) in _BYTE_FREE or _storage_type(module, name) is not None:
        return True
    return module == "torch" and isinstance(vars(torch).get(name), torch.dtype)  # no lazy import of torch's


class _Scanner(pickle.Unpickler):
    def __init__(self, raw: bytes) -> None:
        super().__init__(io.BytesIO(raw), encoding="utf-8")
        self.found: list[Reference] = []
        self.views: list[str] = []
        self.byte_free = True  # every global it names rebuilds without reading storage bytes
        self.locations: set[str] = set()

    def find_class(self, module: str, name: str) -> Any:
        self.byte_free = self.byte_free and _byte_free(module, name)
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return self._rebuild_tensor
        return _storage_type(module, name) or _Inert

    def _rebuild_tensor(self, storage: Any = None, offset: Any = 0, size: Any = (), stride: Any = (),
                        *_rest: Any, **_kwargs: Any) -> _Inert:
        problem = _view_problem(storage, offset, size, stride)
        if problem:
            self.views.append(problem)
        return _Inert()

    def persistent_load(self, pid: Any) -> Any:
        ref = _reference(pid)
        self.locations.add(str(pid[3]))
        self.found.append(ref)
        return _StorageRef(ref)


def _reference(pid: Any) -> Reference:
    if not isinstance(pid, tuple) or len(pid) != 5:
        raise _Problem(f"a persistent id is {type(pid).__name__} {str(pid)[:60]}, not torch's storage tuple")
    kind, storage_type, key, _location, numel = pid
    if kind not in ("storage", b"storage"):
        raise _Problem(f"unknown persistent id kind {str(kind)[:40]!r}")
    if isinstance(key, bytes):
        key = key.decode("ascii", "replace")
    if not isinstance(key, str) or isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise _Problem(f"storage reference ({str(key)[:40]!r}, {str(numel)[:40]}) is not a key and a count")
    if not isinstance(storage_type, _StorageType):
        raise _Problem(f"storage {key!r} has an unknown storage type")
    return Reference(key, numel * storage_type.itemsize, storage_type.itemsize)


def references(raw: bytes) -> tuple[list[Reference], list[str], str | None]:
    """Every storage reference in the pickle ``raw``, what is wrong with its tensor views (torch's
    ``_rebuild_tensor_v2``: offset, size and stride inside the storage), and what is wrong with
    the pickle if it cannot be read to its end (what was found until then is returned too)."""
    scanner = _Scanner(raw)
    try:
        scanner.load()
    except _Problem as e:
        return scanner.found, scanner.views, str(e)
    except RecursionError:
        return scanner.found, scanner.views, "the pickle nests too deeply"
    except Exception as e:  # noqa: BLE001 - any damage in a pickle surfaces here, named
        return scanner.found, scanner.views, f"the pickle is damaged ({type(e).__name__}: {str(e)[:120]})"
    return scanner.found, scanner.views, None


def rebuild_reads_no_bytes(raw: bytes, small: Mapping[str, bytes], map_location: Any) -> bool:
    """True when torch's loader, given the pickle ``raw`` (and the file's ``small`` records),
    builds every tensor as a view of its storage without reading a byte of it: the pickle names
    only tensors, parameters, storage types and plain values (no subclass, sparse or quantized
    tensor, nothing whose rebuild runs code), every storage is a CPU one and stays on the CPU
    (``map_location`` None or the CPU), and the bytes need no byte swap. The object can then be
    rebuilt while its bytes are still being read."""
    if map_location is not None and str(map_location) != "cpu":
        return False
    if small.get("byteorder", b"").decode(errors="replace") != sys.byteorder:
        return False
    scanner = _Scanner(raw)
    try:
        scanner.load()
    except Exception:  # noqa: BLE001 - a damaged pickle: the loader will say what is wrong
        return False
    return scanner.byte_free and scanner.locations <= {"cpu"}


def binding_problems(raw: bytes, sizes: Mapping[str, int]) -> list[str]:
    """What is wrong between the pickle ``raw`` and the storages held, ``sizes`` (key -> bytes).

    Empty when every reference names a held storage of exactly its size, no key is referred to
    with two sizes, and every held storage is referred to.
    """
    found, views, damage = references(raw)
    problems = ([damage] if damage else []) + views
    seen: dict[str, int] = {}
    for ref in found:
        if seen.setdefault(ref.key, ref.nbytes) != ref.nbytes:
            problems.append(f"storage {ref.key!r} is referred to with {seen[ref.key]} and {ref.nbytes} bytes")
        elif ref.key not in sizes:
            problems.append(f"the skeleton refers to storage {ref.key!r}, which the checkpoint does not hold")
        elif sizes[ref.key] != ref.nbytes:
            problems.append(f"storage {ref.key!r} holds {sizes[ref.key]} bytes, but the skeleton's tensor needs "
                            f"{ref.nbytes}")
    if not damage:
        problems += [f"storage {k!r} is held but the skeleton never refers to it" for k in sizes if k not in seen]
    return problems
