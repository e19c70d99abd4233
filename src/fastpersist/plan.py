"""The write plan: which bytes of which storage each writer writes. Pure: no I/O, no torch.

A checkpoint's storages are laid end to end in a virtual byte stream (in the order torch's
pickler met them, which is the same on every rank for the same state). The stream is cut into
one contiguous range per writer slot (a writer rank x one of its roots), each as close as
possible to ``total / slots`` bytes:

* a cut inside a storage falls on a multiple of the alignment unit (4 KiB) of that storage, or
  on its end, whichever is nearest to the ideal cut; so every writer's load is within one
  alignment unit of the ideal, and extents start where O_DIRECT can write them;
* a storage smaller than the unit is never split: the cut moves to its start or end, so small
  storages stay packed together in one writer's file and are written inside large requests.

Every rank computes the same plan from the same sizes; :func:`plan_digest` is what the ranks
compare before any byte is written. Where an extent lands inside its writer's file is the
writer's own choice (it depends on memory addresses), and is recorded in the manifest.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

ALIGN = 4096


@dataclass(frozen=True)
class Extent:
    """``nbytes`` bytes of storage number ``storage``, from byte ``start``, written by ``slot``."""

    storage: int
    start: int
    nbytes: int
    slot: int

    @property
    def end(self) -> int:
        return self.start + self.nbytes


def _nearest_cut(rel: Fraction, size: int, align: int) -> int:
    """The allowed cut inside a storage of ``size`` bytes nearest to ``rel`` (ties go down)."""
    low = (int(rel) // align) * align
    high = min(low + align, size)
    return low if rel - low <= high - rel else high


def cuts(sizes: Sequence[int], slots: int, align: int = ALIGN) -> list[int]:
    """The ``slots + 1`` cut points in the virtual stream (first 0, last the total)."""
    if slots < 1:
        raise ValueError(f"a plan needs at least one writer slot, got {slots}")
    if align < 1:
        raise ValueError(f"alignment must be positive, got {align}")
    if any(n < 0 for n in sizes):
        raise ValueError("storage sizes cannot be negative")
    total = sum(sizes)
    out = [0]
    i = 0  # storage holding the current ideal cut
    prefix = 0  # stream offset of storage i
    for w in range(1, slots):
        ideal = Fraction(total * w, slots)
        while i < len(sizes) and prefix + sizes[i] <= ideal:
            prefix += sizes[i]
            i += 1
        if i == len(sizes):
            out.append(total)
            continue
        out.append(prefix + _nearest_cut(ideal - prefix, sizes[i], align))
    out.append(total)
    return out


def plan(sizes: Sequence[int], slots: int, align: int = ALIGN) -> list[Extent]:
    """Extents covering every byte of every storage exactly once, in stream order.

    Empty storages get no extent. Each slot's extents are contiguous in the stream.
    """
    bounds = cuts(sizes, slots, align)
    extents: list[Extent] = []
    slot = 0
    pos = 0  # stream offset of storage s
    for s, size in enumerate(sizes):
        start = 0
        while start < size:
            while bounds[slot + 1] <= pos + start:
                slot += 1
            end = min(size, bounds[slot + 1] - pos)
            extents.append(Extent(s, start, end - start, slot))
            start = end
        pos += size
    return extents


def slot_loads(extents: Sequence[Extent], slots: int) -> list[int]:
    """Bytes each slot writes."""
    loads = [0] * slots
    for e in extents:
        loads[e.slot] += e.nbytes
    return loads


def plan_digest(sizes: Sequence[int], slots: int, align: int = ALIGN, extra: bytes = b"") -> str:
    """A short hash of everything the plan depends on (plus ``extra``), for ranks to compare."""
    h = hashlib.sha256()
    h.update(f"fastpersist-plan-1|{slots}|{align}|{len(sizes)}|".encode())
    h.update(",".join(map(str, sizes)).encode())
    h.update(b"|")
    h.update(extra)
    return h.hexdigest()[:32]
