"""What must be copied at save time, and the bounded host memory it is copied into.

A checkpoint must equal the state at the moment ``save()`` was called, whatever training does
afterwards. The skeleton (Python values, tensor metadata) is pickled inside ``save()``, so it is
already a copy. The storages are the question:

* ``snapshot`` mode copies every storage into a :class:`Arena` (reusable, page-aligned, pinned
  when CUDA is present, never larger than its byte budget), then writes from there;
* ``overlap`` mode copies only the storages nothing guards. Storages of parameters and optimizer
  state of a protected optimizer are written from live memory: only ``optimizer.step()``
  changes them, and its pre-hook waits until they are written.

A copy from device memory is a device-to-host copy into pinned memory on a side stream.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

import torch

from fastpersist.errors import CheckpointError
from fastpersist.format import torchzip
from fastpersist.io.buffers import ALIGN, align_up, aligned_empty


class Arena:
    """Up to ``budget`` bytes of host memory for snapshots, reused save after save.

    One snapshot holds the arena from :meth:`take` until :meth:`give_back`; a second snapshot
    waits. Host memory for snapshots therefore never exceeds the budget.
    """

    def __init__(self, budget: int) -> None:
        if budget < 0:
            raise CheckpointError(f"the snapshot budget cannot be negative, got {budget}")
        self.budget = budget
        self._buffer: torch.Tensor | None = None
        self._free = threading.Event()
        self._free.set()

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.budget

    def take(self, nbytes: int, timeout: float | None = None) -> torch.Tensor:
        """At least ``nbytes`` (at most the budget) of arena, once the previous user gave it back.

        The memory grows to the largest snapshot taken so far and is then reused.
        """
        if not self.fits(nbytes):
            raise CheckpointError(f"a snapshot of {nbytes} bytes exceeds the arena's budget of {self.budget}")
        if not self._free.wait(timeout):
            raise TimeoutError("the snapshot arena is still in use")
        self._free.clear()
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = None  # free the smaller one first
            self._buffer = aligned_empty(align_up(nbytes))
        return self._buffer

    def give_back(self) -> None:
        self._free.set()

    @property
    def allocated(self) -> int:
        return 0 if self._buffer is None else self._buffer.numel()


def storage_key(storage: torch.UntypedStorage) -> tuple[str, int]:
    return (storage.device.type, storage.data_ptr())


def guarded_storages(tensors: Iterable[torch.Tensor]) -> set[tuple[str, int]]:
    return {storage_key(t.untyped_storage()) for t in tensors}


def snapshot_bytes(storages: Sequence[torch.UntypedStorage], live: set[tuple[str, int]]) -> int:
    """Arena bytes needed to copy every storage not in ``live`` (each starts page-aligned)."""
    return sum(align_up(s.nbytes()) for s in storages if storage_key(s) not in live)


def copy_into(storages: list[torch.UntypedStorage], live: set[tuple[str, int]], arena: torch.Tensor) -> int:
    """Replace each storage not in ``live`` by a copy in ``arena`` (in place in the list).

    Returns the bytes copied. Copies on a device go through a side stream and are waited for.
    """
    pos = 0
    copied = 0
    stream = None
    for i, s in enumerate(storages):
        if storage_key(s) in live or s.nbytes() == 0:
            continue
        n = s.nbytes()
        dst = arena[pos : pos + n]
        src = torchzip.byte_view(s)
        if src.device.type == "cuda":  # pragma: no cover - no GPU in CI
            if stream is None:
                stream = torch.cuda.Stream(device=src.device)
                stream.wait_stream(torch.cuda.current_stream(src.device))
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        else:
            dst.copy_(src)
        storages[i] = dst.untyped_storage()[dst.storage_offset() : dst.storage_offset() + n]  # type: ignore[index]
        pos += align_up(n, ALIGN)
        copied += n
    if stream is not None:  # pragma: no cover
        stream.synchronize()
    return copied
