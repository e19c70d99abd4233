"""What ``save()`` captures: a structural copy of a state, its storages copied into the arena
(or aliased, when a guard protects them), so the checkpoint is the state at the call.

A state of plain containers, tensors and immutable values (what state_dicts hold) is captured
structurally and pickled in the background; anything else is pickled inside ``save()`` and only
its storages are captured. A copy from device memory is a device-to-host copy into page-locked
memory on a side stream of its device, ordered after the work training queued before ``save()``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from fastpersist import torch_internals
from fastpersist.errors import CheckpointError
from fastpersist.format import skeleton, torchzip
from fastpersist.io.buffers import ALIGN, align_up, ready_events
from fastpersist.io.fills import Fill

COPY_STEP = 32 << 20  # a deferred copy lands (and may be written) in batches of about this size


def storage_key(storage: torch.UntypedStorage) -> int:
    """A storage's identity: its address (unique across host and devices: CUDA's unified
    virtual addressing gives device memory addresses apart from host memory)."""
    return storage.data_ptr()


def guarded_storages(tensors: Iterable[torch.Tensor]) -> set[int]:
    return {storage_key(t.untyped_storage()) for t in tensors}


# Values a capture keeps as they are (the object itself): immutable, and pickled the same way
# at any later time. Subclasses of int, float, complex, str and bytes without an instance
# dictionary (numpy's scalars) and enum members are immutable too; anything else is not plain.
_IMMUTABLE = {int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size}
_SCALARS = (int, float, complex, str, bytes)


def _immutable(obj: Any) -> bool:
    t = type(obj)
    if t in _IMMUTABLE:
        return True
    return isinstance(obj, enum.Enum) or (isinstance(obj, _SCALARS) and not hasattr(obj, "__dict__"))


def _tensors(obj: Any, out: dict[int, torch.UntypedStorage]) -> bool:
    """Collect the storages of the tensors in ``obj``; False if something a capture would not
    rebuild exactly was met. The containers are the exact built-in types (an OrderedDict may
    carry attributes, as a module's state_dict carries ``_metadata``); a tensor is a dense
    torch.Tensor or Parameter, neither quantized, nested, nor a conjugate or negative view (a
    subclass or any other is pickled at save time instead, the way torch.save pickles it), and
    its Python attributes (torch.compile marks optimizer state with
    ``_dynamo_static_input_type``) are plain too: the capture copies them."""
    t = type(obj)
    if t is dict:
        return all([_tensors(v, out) for v in obj.values()])
    if t is list or t is tuple:
        return all([_tensors(v, out) for v in obj])
    if t is torch.Tensor or t is torch.nn.Parameter:
        if not skeleton.rebuilds_exactly(obj):
            return False
        s = obj.untyped_storage()
        out.setdefault(storage_key(s), s)
        attrs = obj.__dict__
        return not attrs or _tensors(attrs, out)
    if isinstance(obj, torch.Tensor):  # a subclass: pickled in save()
        return False
    if t is OrderedDict:
        return all([_tensors(v, out) for v in obj.values()]) and _tensors(vars(obj), out)
    return _immutable(obj)


def scan(obj: Any) -> tuple[bool, list[torch.UntypedStorage]]:
    """Whether ``obj`` is *plain* (only containers, tensors and immutable values: a state_dict's
    usual content, which :func:`capture` can copy without pickling it), and its storages."""
    found: dict[int, torch.UntypedStorage] = {}
    is_plain = _tensors(obj, found)
    return is_plain, list(found.values())


def copy_bytes(storages: Iterable[torch.UntypedStorage], live: set[int]) -> int:
    """Arena bytes needed to copy the storages not in ``live`` (each copy starts page-aligned)."""
    found = {storage_key(s): s for s in storages}
    return sum(align_up(s.nbytes()) for k, s in found.items() if k not in live)



class Capture:
    """A structural copy of a state: containers rebuilt, tensors re-pointed.

    Tensors on a ``live`` storage become aliases (same memory, metadata fixed now); every other
    storage is copied once into the arena and its tensors become views of the copy, so storages
    shared by several tensors stay shared. Only :func:`plain` objects can be captured this way;
    others are pickled at save time and only their storages are captured (:meth:`storage`). One
    capture serves a whole save, so a storage shared by several objects is copied once.
    """

    def __init__(self, live: set[int], arena: torch.Tensor | None, deferred: bool = False) -> None:
        self.live = live
        self.arena = arena
        self.pos = 0
        self.copied = 0
        # deferred: host-to-host copies are only laid out here and made by copy() (in arena order)
        self.deferred = deferred
        self.pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []  # (destination, source, arena offset)
        self.copies: dict[int, torch.UntypedStorage] = {}
        self.streams: dict[torch.device, Any] = {}  # one side stream per device copied from
        self.live_seen: list[torch.UntypedStorage] = []

    def storage(self, s: torch.UntypedStorage) -> torch.UntypedStorage:
        key = storage_key(s)
        if key in self.live:
            self.live_seen.append(s)
            return s
        done = self.copies.get(key)
        if done is not None:
            return done
        n = s.nbytes()
        if n == 0:  # nothing to copy; a fresh empty storage (arena slices would alias the next copy)
            self.copies[key] = torch.UntypedStorage(0)
            return self.copies[key]
        if self.arena is None or self.pos + n > self.arena.numel():
            raise CheckpointError("internal: the snapshot arena is smaller than the state it must hold")
        dst = self.arena[self.pos : self.pos + n]
        src = torchzip.byte_view(s)
        if src.device.type == "cuda":  # pragma: no cover - no GPU in CI (tests/unit/io/test_gpu.py)
            stream = self.streams.get(src.device)
            if stream is None:  # device-to-host copies on a side stream of that device, into pinned memory
                stream = self.streams[src.device] = torch.cuda.Stream(device=src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        elif self.deferred:
            self.pending.append((dst, src, self.pos))
        else:
            dst.copy_(src)
        self.pos += align_up(n, ALIGN)
        self.copied += n
        out = dst.untyped_storage()[dst.storage_offset() : dst.storage_offset() + n]  # type: ignore[index]
        self.copies[key] = out
        return out

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() in self.live:
            self.live_seen.append(storage)
            view = t.detach()  # same memory; shape, strides and offset fixed now
        else:
            s = self.storage(storage)
            view = torch.empty(0, dtype=t.dtype, device=s.device).set_(s, t.storage_offset(), t.size(), t.stride())
        if type(t) is not torch.Tensor and isinstance(t, torch.nn.Parameter):
            return torch.nn.Parameter(view, requires_grad=t.requires_grad)
        if t.requires_grad:
            view.requires_grad_(True)
        return view

    def __call__(self, obj: Any) -> Any:
        """A copy of the plain object ``obj`` (:func:`scan`) that pickles as ``obj`` would have
        pickled at this moment."""
        t = type(obj)
        if t is dict:
            return {k: self(v) for k, v in obj.items()}
        if t is list:
            return [self(v) for v in obj]
        if t is tuple:
            return tuple([self(v) for v in obj])
        if isinstance(obj, torch.Tensor):
            view = self.tensor(obj)
            attrs = obj.__dict__
            if attrs:
                vars(view).update(self(attrs))
            return view
        if t is OrderedDict:
            out: OrderedDict[Any, Any] = OrderedDict([(k, self(v)) for k, v in obj.items()])
            attrs = vars(obj)
            if attrs:
                vars(out).update(self(attrs))
            return out
        if _immutable(obj):
            return obj
        raise CheckpointError(f"internal: {type(obj).__name__} cannot be captured without pickling")

    def copy(self, fill: Fill) -> None:
        """Make the deferred copies front to back, advancing ``fill`` as they land: the writer
        reads each part of the arena as soon as it holds its copy (fastpersist.io.fills).

        Copies go in batches of about COPY_STEP bytes, each one call to torch: between calls
        this thread needs the GIL again, and the save's background thread may hold it for up
        to the interpreter's switch interval (5 ms), so a state of many small tensors copied
        one call each would keep ``save()`` waiting for the GIL far longer than copying."""
        dsts: list[torch.Tensor] = []
        srcs: list[torch.Tensor] = []
        batch = 0
        for dst, src, pos in self.pending:
            n = dst.numel()
            for start in range(0, n, COPY_STEP):
                end = min(n, start + COPY_STEP)
                dsts.append(dst[start:end])
                srcs.append(src[start:end])
                batch += end - start
                if batch >= COPY_STEP:
                    torch_internals.copy_many(dsts, srcs)
                    fill.advance(pos + end)
                    dsts, srcs, batch = [], [], 0
        if dsts:
            torch_internals.copy_many(dsts, srcs)
        self.pending.clear()

    def finish(self) -> None:
        for stream in self.streams.values():  # pragma: no cover - no GPU in CI (tests/unit/io/test_gpu.py)
            stream.synchronize()
        ready_events.mark(self.live_seen)  # guarded device storages: the save point, for the writer
