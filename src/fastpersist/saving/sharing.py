"""Overlap mode with the process engine: protected optimizers' tensors moved into shared memory.

In overlap mode the writer reads the parameters and optimizer state of protected optimizers
from live memory while the next iteration runs (``optimizer.step()`` waits until they are
written). With the process engine the writer is another process, so that memory must be shared:
at a save, each protected optimizer's host tensors not in shared memory yet are copied, once,
into a :class:`fastpersist.io.buffers.SharedMemory` region, and the parameter (``p.data``) or
the state entry is re-pointed to the copy; the model and the optimizer keep working on them in
place, and no later save copies them. Only what is new is moved at a later save (a state entry
the optimizer created, a storage it replaced): the check is one pass over the optimizer's
tensors comparing storage addresses with the regions' ranges.

Moved: dense CPU tensors (parameters and state entries) of the protected optimizers. Left where
they are, and copied into the snapshot arena at each save instead: device tensors (a
device-to-host copy is the capture on a GPU), DTensors (their local shards belong to FSDP2's own
buffers) and anything that is not a plain tensor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from fastpersist.io.buffers import ALIGN, SharedMemory, align_up

logger = logging.getLogger(__name__)


@dataclass
class Region:
    """One shared-memory region holding moved tensors; ``number`` names it to the save process."""

    number: int
    memory: SharedMemory

    @property
    def base(self) -> int:
        return self.memory.tensor.data_ptr()

    @property
    def size(self) -> int:
        return self.memory.tensor.numel()

    def holds(self, addr: int) -> bool:
        return self.base <= addr < self.base + self.size


def _movable(t: object) -> bool:
    return (type(t) is torch.Tensor or type(t) is torch.nn.Parameter) and t.device.type == "cpu" \
        and not t.is_sparse and not t.is_quantized and t.layout == torch.strided  # type: ignore[union-attr]


class SharedLive:
    """The shared regions of one Checkpointer's protected optimizers (see the module)."""

    def __init__(self) -> None:
        self.regions: list[Region] = []
        self._seen: list[int] = []  # the data addresses of the tensors of the last save, in order
        self._live: dict[int, tuple[Any, int]] = {}
        self._made = 0  # regions made (their numbers)

    def _shared(self, t: torch.Tensor) -> bool:
        addr = t.data_ptr()
        return any(r.holds(addr) for r in self.regions)

    def share(self, optimizers: list[torch.optim.Optimizer]) -> dict[int, tuple[Any, int]]:
        """Move what is not shared yet (see the module); the storages now in shared memory, by
        address, each with its region's name and base address (:class:`fastpersist.saving.ship.Encoder`).

        While every tensor's data address is the one of the last save, nothing moved: one pass
        of ``data_ptr()`` decides it (a storage replaced has another address)."""
        tensors = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        tensors += [v for opt in optimizers for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        seen = [t.data_ptr() for t in tensors]
        if seen == self._seen:
            return self._live
        tensors = [t for t in tensors if _movable(t)]
        params = [p for opt in optimizers for group in opt.param_groups for p in group["params"]
                  if _movable(p) and not self._shared(p)]
        entries = [(st, k) for opt in optimizers for st in opt.state.values() for k, v in st.items()
                   if _movable(v) and not self._shared(v)]  # type: ignore[arg-type]
        storages: dict[int, torch.UntypedStorage] = {}
        for t in params + [st[k] for st, k in entries]:  # type: ignore[misc]
            s = t.untyped_storage()
            storages.setdefault(s.data_ptr(), s)
        if storages:
            self._move(storages, params, entries)
        tensors = [p for opt in optimizers for group in opt.param_groups for p in group["params"]]
        tensors += [v for opt in optimizers for st in opt.state.values() for v in st.values()
                    if isinstance(v, torch.Tensor)]
        self._seen = [t.data_ptr() for t in tensors]
        self._live = {}
        used = set()
        for t in tensors:
            if _movable(t):
                key = t.untyped_storage().data_ptr()
                region = next((r for r in self.regions if r.holds(key)), None)
                if region is not None:
                    self._live[key] = (("r", region.number), region.base)
                    used.add(region.number)
        # a region none of whose tensors the optimizers hold any more (all replaced) is let go:
        # its memory goes with the last view of it (the save process unmaps it too)
        self.regions = [r for r in self.regions if r.number in used]
        return self._live

    def _move(self, storages: dict[int, torch.UntypedStorage], params: list[torch.Tensor],
              entries: list[tuple[dict[str, object], str]]) -> None:
        total = sum(align_up(max(s.nbytes(), 1), ALIGN) for s in storages.values())
        self._made += 1
        region = Region(self._made, SharedMemory(total, name="fastpersist-live"))
        moved: dict[int, torch.UntypedStorage] = {}
        pos = 0
        whole = region.memory.tensor.untyped_storage()
        for key, s in storages.items():
            n = s.nbytes()
            dst = whole[pos : pos + n]
            if n:
                region.memory.tensor[pos : pos + n].copy_(torch.empty(0, dtype=torch.uint8).set_(s, 0, (n,), (1,)))
            moved[key] = dst
            pos += align_up(max(n, 1), ALIGN)
        self.regions.append(region)

        def rebased(t: torch.Tensor) -> torch.Tensor:
            s = moved[t.untyped_storage().data_ptr()]
            return torch.empty(0, dtype=t.dtype).set_(s, t.storage_offset(), t.size(), t.stride())

        with torch.no_grad():
            for p in params:
                p.data = rebased(p)
            for st, k in entries:
                v = st[k]
                new = rebased(v)  # type: ignore[arg-type]
                if type(v) is torch.nn.Parameter:
                    new = torch.nn.Parameter(new, requires_grad=v.requires_grad)  # type: ignore[union-attr]
                st[k] = new
        logger.debug("moved %d storages (%.1f MiB) of protected optimizers into shared memory", len(storages),
                     total / 2**20)
