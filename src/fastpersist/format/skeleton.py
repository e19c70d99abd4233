"""The object skeleton: torch's pickle and small records, and rebuilding an object from it.

torch's serializer splits an object into a pickle (``data.pkl``: the structure, Python values,
tensor views that refer to storages by key) plus a few small records (``byteorder``,
``.format_version``...) and the storages' bytes. A sharded checkpoint keeps the small records in
one *skeleton file*: a stored (uncompressed) zip archive holding exactly those records, readable
with any zip tool. :func:`rebuild` hands torch's own loader the skeleton and one host buffer
holding every storage, so objects come back exactly as ``torch.load`` would build them.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
import sys
import time
import zipfile
from collections.abc import Iterator
from typing import Any

import torch

from fastpersist import torch_internals
from fastpersist.errors import CheckpointReadError, CorruptCheckpointError
from fastpersist.format import zipdir

_DATE = (2020, 1, 1, 0, 0, 0)  # fixed, so the same state gives the same bytes
MAX_SKELETON_BYTES = 256 << 20  # a skeleton (or data.pkl) larger than this is refused before it is read


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The block runs with the interpreter's cyclic garbage collector paused (pickling a
    state, ``fastpersist.save`` from its pickle to its fsync).

    Pickling a state allocates many small containers, enough to start the collector's full
    pass, which walks every object of the process (torch alone holds hundreds of thousands):
    measured here, a 2 GiB GPT state's layout took 0.18-0.27 s when that pass fell inside it
    and 0.02-0.06 s when it did not, and the save's first byte waits for it. What pickling
    allocates is freed by reference counting; the collector runs again, as before, after the
    block (its pass, if due, then falls outside the save). Process-wide: another thread's
    allocations do not start it meanwhile either. Left alone if the caller disabled it."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def serialize(obj: object, protocol: int = 2, marks: type | None = None
              ) -> tuple[dict[str, bytes], list[str], list[torch.UntypedStorage]]:
    """Pickle ``obj`` the way ``torch.save`` does, keeping its storages as references.

    Returns torch's small records (``data.pkl``, ``.format_version``, ``.storage_alignment``,
    ``byteorder``), the storage keys in torch's order and the storages (not copied). The
    pickle is byte-for-byte what torch.save would write; only the per-object hook is leaner
    than torch's (it runs for every object pickled, so it is the cost of a save's skeleton).
    Objects of type ``marks`` are written as the persistent id in their ``pid`` attribute
    (fastpersist.format.template cuts its templates at them).
    """
    keys: dict[int, str] = {}
    storages: list[torch.UntypedStorage] = []
    dtypes: dict[int, torch.dtype] = {}
    locations: dict[torch.device, str] = {}
    typed, is_storage = torch.storage.TypedStorage, torch.is_storage

    def storage_id(o: Any) -> tuple[str, Any, str, str, int] | None:
        if isinstance(o, typed):
            storage, dtype, numel = o._untyped_storage, o.dtype, o._size()
            storage_type = getattr(torch, o._pickle_storage_type())
        elif is_storage(o):
            storage, dtype, numel = o, torch.uint8, o.nbytes()
            storage_type = torch.serialization.normalize_storage_type(type(o))
        else:
            return None
        ptr = storage.data_ptr()
        if storage.device.type != "meta" and ptr != 0:
            if dtypes.setdefault(ptr, dtype) != dtype:
                raise RuntimeError("Cannot save multiple tensors or storages that view the same data as different types")
        key = keys.get(storage._cdata)
        if key is None:
            key = keys[storage._cdata] = str(len(keys))
            storages.append(storage)
        location = locations.get(storage.device)
        if location is None:
            location = locations[storage.device] = torch.serialization.location_tag(storage)
        return ("storage", storage_type, key, location, numel)

    calls = [0]

    class _Pickler(pickle.Pickler):
        def persistent_id(self, o: Any) -> Any:
            calls[0] += 1
            if not calls[0] & 127:
                time.sleep(0)  # let a waiting training thread take the GIL now, not in 5 ms
            t = type(o)
            if t is int or t is str or t is tuple or t is float or t is dict or t is list or t is bool:
                return None
            if t is marks:
                return o.pid
            return storage_id(o)

    buf = io.BytesIO()
    with collector_paused():
        _Pickler(buf, protocol=protocol).dump(obj)
    return {"data.pkl": buf.getvalue(), **small_records()}, list(keys.values()), storages


def rebuilds_exactly(t: torch.Tensor) -> bool:
    """Whether the tensor ``t`` (a torch.Tensor or Parameter, exactly) is its storage's bytes
    viewed through dtype, offset, shape and strides: dense, neither quantized, nested, nor a
    conjugate or negative view. Such a tensor can be re-pointed to a copy of its storage (the
    background modes' capture) and is pickled by its storage alone (the skeleton templates)."""
    return (t.layout is _STRIDED and not t.is_quantized and not t.is_nested and not t.is_conj()
            and not t.is_neg())


_STRIDED = torch.strided


def small_records() -> dict[str, bytes]:
    """torch's small records beside ``data.pkl``."""
    return {
        ".format_version": b"1",
        ".storage_alignment": str(torch_internals.storage_alignment()).encode(),
        "byteorder": sys.byteorder.encode(),
    }


def encode(records: dict[str, bytes]) -> bytes:
    """The skeleton file for torch's small records (every record except storages)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name in sorted(records):
            z.writestr(zipfile.ZipInfo(name, _DATE), records[name])
    return out.getvalue()


def decode(path: str, raw: bytes) -> dict[str, bytes]:
    """The records of a skeleton file, read with the strict zip reader (stored records only,
    no overlaps; nothing is inflated)."""
    found = zipdir.read_directory(path, zipdir.bytes_reader(path, raw), len(raw))
    records = {r.name: raw[r.offset : r.offset + r.nbytes] for r in found}
    if "data.pkl" not in records:
        raise CorruptCheckpointError(f"{path} is not a skeleton file: it has no data.pkl record")
    return records


class ArchiveView:
    """What ``torch.serialization._load`` needs of a zip reader, served from memory.

    ``small`` holds the small records; ``offsets`` maps each storage record name
    (``data/<key>``) to the offset of its bytes in the buffer handed to :func:`rebuild`.
    """

    def __init__(self, small: dict[str, bytes], offsets: dict[str, int]) -> None:
        self._small = small
        self._offsets = offsets

    def has_record(self, name: str) -> bool:
        return name in self._small or name in self._offsets

    def get_record(self, name: str) -> bytes:
        return self._small[name]

    def get_record_offset(self, name: str) -> int:
        return self._offsets[name]

    def get_record_header_offset(self, name: str) -> int:
        return self._offsets[name]

    def get_record_offset_no_read(self, _current: int, name: str, _numel: int, _align: int) -> int:
        return self._offsets[name]

    def serialization_id(self) -> str:
        return self._small.get(".data/serialization_id", b"").decode(errors="replace")

    def get_all_records(self) -> list[str]:
        return [*self._small, *self._offsets]


def rebuild(path: str, archive: ArchiveView, storage: torch.UntypedStorage | None,
            map_location: Any, weights_only: bool) -> Any:
    """Unpickle the skeleton with storages sliced out of ``storage`` (no copy).

    With ``storage=None`` and ``map_location="meta"`` nothing is read: every tensor is built on
    the meta device, which is how ``verify`` runs the very unpickling ``load`` runs. Whatever
    goes wrong inside torch's loader (a damaged pickle or small record) is a
    :class:`CheckpointReadError` naming ``path``.
    """
    pickle_module: Any = torch_internals.weights_only_unpickler() if weights_only else pickle
    try:
        return torch_internals.load_records(archive, map_location, pickle_module, storage)
    except pickle.UnpicklingError as e:
        if weights_only:
            raise CheckpointReadError(
                f"{path}: the weights-only loader refused the checkpoint ({e}). If you trust its "
                "source, load it with weights_only=False"
            ) from e
        raise CheckpointReadError(f"{path}: the object skeleton cannot be unpickled: {e}") from e
    except KeyError as e:
        raise CorruptCheckpointError(f"{path}: the skeleton refers to storage {e} that the checkpoint lacks") from e
    except MemoryError:
        raise
    except RecursionError as e:
        raise CorruptCheckpointError(f"{path}: the object skeleton nests too deeply to rebuild") from e
    except Exception as e:  # noqa: BLE001 - torch's loader raises anything on a damaged skeleton
        raise CorruptCheckpointError(
            f"{path}: the object skeleton is damaged: torch's loader failed with {type(e).__name__}: {str(e)[:200]}"
        ) from e
