"""Copies of a rank's unique bytes on other nodes (beside the write phase of a save, several nodes).

The replicated state needs no network for its copies (every node holds it; see
:mod:`fastpersist.topology`). What only one rank holds, its ``rank_state`` and the DTensor pieces
it writes, is sent to a *partner* rank on each of the next ``redundancy - 1`` nodes (the rank with
the same local index there), over the Checkpointer's own process group, while the rank writes its
own files. The partner writes the bytes into files of its own node, cut into the same extents as
the owner's files (so each copy is the same bytes with the same checksum, hashed again by the
partner from what it received) and reports them like any file it wrote; the commit then lists
them as the extents' copies. Memory: one message (at most :data:`MESSAGE_BYTES`) per sender and
one being sent, whatever the state's size.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from fastpersist.objects import dtensor
from fastpersist.errors import CheckpointWriteError
from fastpersist.format import manifest as mf
from fastpersist.format import torchzip
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import memory_view
from fastpersist.io.fills import wait_filled
from fastpersist.topology import NodeMap
from fastpersist.objects.write import FileReport, PlacedExtent, Prepared, chunk_extents, place
from fastpersist.plan import plan

MESSAGE_BYTES = 32 << 20


def partners(nodes: NodeMap, rank: int, copies: int) -> list[int]:
    """The ranks that keep copies of ``rank``'s unique bytes: the rank of the same local index
    (modulo their count) on each of the next ``copies - 1`` nodes."""
    node = nodes.of_rank[rank]
    local = nodes.ranks(node).index(rank)
    out = []
    for c in range(1, copies):
        there = nodes.ranks((node + c) % nodes.count)
        out.append(there[local % len(there)])
    return out


def senders(nodes: NodeMap, rank: int, copies: int) -> list[int]:
    """The ranks whose unique bytes ``rank`` keeps copies of."""
    return [k for k in range(len(nodes.of_rank)) if rank in partners(nodes, k, copies)]


@dataclass(frozen=True)
class Unique:
    """One extent of a rank's unique bytes: its rank_state's skeleton (``kind`` "skeleton"), a
    storage's bytes of its rank_state ("own", ``index`` the storage) or of a DTensor chunk it
    writes ("chunk", ``index`` the chunk, ``start`` counted from the chunk's first byte)."""

    kind: str
    index: int
    start: int
    nbytes: int


def unique_extents(own: tuple[int, list[int]] | None, pieces: Sequence[dtensor.Piece], roots: int) -> list[Unique]:
    """A rank's unique bytes, cut exactly as its own files cut them (:func:`plan` over its roots
    for the rank_state, :func:`chunk_extents` for its pieces), in a fixed order.
    ``own`` is (skeleton length, storage sizes) of its rank_state, or None."""
    out = []
    if own is not None:
        out.append(Unique("skeleton", 0, 0, own[0]))
        out += [Unique("own", e.storage, e.start, e.nbytes) for e in plan(own[1], roots)]
    cut = chunk_extents([(i, x.start, x.nbytes) for i, x in enumerate(pieces)], roots)
    out += [Unique("chunk", pieces[e.storage].chunk, e.start, e.nbytes) for e in cut]
    return out


def messages(extents: Sequence[Unique]) -> list[list[tuple[int, int, int]]]:
    """The byte stream of ``extents`` in messages of at most MESSAGE_BYTES: each a list of
    (extent index, offset in the extent, bytes)."""
    out: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = MESSAGE_BYTES
    for i, e in enumerate(extents):
        pos = 0
        while pos < e.nbytes:
            n = min(room, e.nbytes - pos)
            current.append((i, pos, n))
            pos += n
            room -= n
            if room == 0:
                out.append(current)
                current, room = [], MESSAGE_BYTES
    if current:
        out.append(current)
    return out


class Sender:
    """The bytes of this rank's unique extents, from the live state."""

    def __init__(self, extents: Sequence[Unique], own: Prepared | None, shards: Sequence[dtensor.LocalShard],
                 layout: dtensor.Layout) -> None:
        self.extents = list(extents)
        self.own = own
        local = {(sh.meta.path, sh.meta.offsets, sh.meta.sizes): sh.tensor for sh in shards}
        self.chunks = {i: local[(c.path, c.offsets, c.sizes)] for i, c in enumerate(layout.chunks)
                       if (c.path, c.offsets, c.sizes) in local}

    def _bytes(self, e: Unique) -> torch.Tensor:
        if e.kind == "skeleton":
            if self.own is None:  # pragma: no cover - planned from the rank's own proposal
                raise CheckpointWriteError("a rank_state skeleton to send without a rank_state")
            return torch.frombuffer(bytearray(self.own.skeleton), dtype=torch.uint8) if e.nbytes else \
                torch.empty(0, dtype=torch.uint8)
        if e.kind == "own":
            if self.own is None:  # pragma: no cover
                raise CheckpointWriteError("rank_state bytes to send without a rank_state")
            return torchzip.byte_view(self.own.storages[e.index])
        t = self.chunks[e.index]
        base = int(t.storage_offset()) * t.element_size()
        return torchzip.byte_view(t.untyped_storage())[base : base + t.numel() * t.element_size()]

    def message(self, segments: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        parts = []
        for i, off, n in segments:
            e = self.extents[i]
            parts.append(self._bytes(e)[e.start + off : e.start + off + n] if e.kind != "skeleton"
                         else self._bytes(e)[off : off + n])
        for part in parts:  # a snapshot still being copied is sent once its bytes are there
            if part.device.type == "cpu":
                wait_filled(part.data_ptr(), part.numel())
        out = parts[0] if len(parts) == 1 else torch.cat([p.cpu() for p in parts])
        return out.cpu().contiguous()


class Receiver:
    """A partner's side: the copies of one sender's unique extents, written into files of this
    node as they arrive, each extent hashed; :meth:`reports` says what was written."""

    def __init__(self, sender: int, extents: Sequence[Unique], save_id: str, node: int, dirs: Sequence[str],
                 backend: FileBackend) -> None:
        self.sender, self.extents, self.backend = sender, list(extents), backend
        self.hashes = [xxhash.xxh3_64() for _ in self.extents]
        root = sender % len(dirs)
        self.root = root
        own, name = mf.rank_object(sender), f"{save_id}-{mf.rank_object(sender)}-n{node:04d}"
        self.files: dict[str, Any] = {}
        self.names = {"skeleton": f"{name}.skel", "own": f"{name}.bin",
                      "chunk": f"{save_id}-{mf.SHARDED}-r{sender:05d}-n{node:04d}.bin"}
        self.objects = {"skeleton": own, "own": own, "chunk": mf.SHARDED}
        self.offsets: list[int] = []
        size = {"own": 0, "chunk": 0}
        for e in self.extents:
            if e.kind == "skeleton":
                self.offsets.append(0)
                continue
            at = place(size[e.kind], e.nbytes, None)
            self.offsets.append(at)
            size[e.kind] = at + e.nbytes
        self.sizes = size
        self.skeleton = bytearray(next((e.nbytes for e in self.extents if e.kind == "skeleton"), 0))
        self.dirs = list(dirs)

    def _file(self, kind: str) -> Any:
        if kind not in self.files:
            path = os.path.join(self.dirs[self.root], self.names[kind])
            try:
                self.backend.makedirs(self.dirs[self.root])
                file = self.backend.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "off", self.root)
                self.files[kind] = file  # closed by finish() or close(), whatever happens next
                self.backend.truncate(file, self.sizes[kind])
            except OSError as e:
                raise CheckpointWriteError(f"cannot create {path} (rank {self.sender}'s copy): "
                                           f"{e.strerror or e}") from e
        return self.files[kind]

    def take(self, segments: Sequence[tuple[int, int, int]], data: torch.Tensor) -> None:
        view = memory_view(data.data_ptr(), data.numel())
        pos = 0
        for i, off, n in segments:
            e, chunk = self.extents[i], view[pos : pos + n]
            pos += n
            self.hashes[i].update(chunk)
            if e.kind == "skeleton":
                self.skeleton[off : off + n] = chunk
                continue
            file = self._file(e.kind)
            try:
                self.backend.pwrite(file, chunk, self.offsets[i] + off)
            except OSError as e:
                raise CheckpointWriteError(f"writing {file.path} (rank {self.sender}'s copy) failed: "
                                           f"{e.strerror or e}") from e

    def finish(self) -> list[FileReport]:
        """fsync the copies and report them (a skeleton in a file of its own, as the owner's)."""
        out = []
        for kind, file in self.files.items():
            try:
                self.backend.fsync(file)
            except OSError as e:
                raise CheckpointWriteError(f"fsync of {file.path} (rank {self.sender}'s copy) failed: "
                                           f"{e.strerror or e}") from e
            finally:
                file.close()
            placed = tuple(PlacedExtent(e.index, e.start, e.nbytes, self.offsets[i], self.hashes[i].intdigest())
                           for i, e in enumerate(self.extents) if e.kind == kind)
            out.append(FileReport(self.objects[kind], self.root, self.names[kind], self.sizes[kind], placed))
        self.files.clear()
        if any(e.kind == "skeleton" for e in self.extents):
            path = os.path.join(self.dirs[0], self.names["skeleton"])
            try:
                self.backend.makedirs(self.dirs[0])
                self.backend.write_small(path, bytes(self.skeleton), 0)
            except OSError as e:
                raise CheckpointWriteError(f"cannot write {path}: {e.strerror or e}") from e
            out.append(FileReport(self.objects["skeleton"], 0, self.names["skeleton"], len(self.skeleton), (),
                                  xxhash.xxh3_64_intdigest(bytes(self.skeleton))))
        return out

    def close(self) -> None:
        for file in self.files.values():
            file.close()
        self.files.clear()


def exchange(send: Callable[[list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]]], None],
             sender: Sender | None, to: Sequence[int], receivers: Sequence[Receiver]) -> list[FileReport]:
    """Send this rank's unique bytes to its partners ``to`` and receive its senders' into
    ``receivers``, message by message in lock step (``send(sends, recvs)`` posts them all and
    waits); returns the reports of the copies written here.

    Every rank runs every round its partners and senders expect, whatever fails locally: a
    message it cannot build goes out as zeros (the partner's checksum of it cannot match the
    owner's, so the commit refuses it), bytes it cannot write are dropped; the first local
    failure is raised after the last round, when no rank waits for this one any more."""
    mine = messages(sender.extents) if sender is not None else []
    theirs = [messages(r.extents) for r in receivers]
    failure: BaseException | None = None
    try:
        for k in range(max([len(mine), *map(len, theirs)])):
            sends = []
            if sender is not None and k < len(mine) and to:
                try:
                    data = sender.message(mine[k])
                except Exception as e:  # noqa: BLE001 - the partners still expect this message
                    failure = failure or e
                    data = torch.zeros(sum(n for _, _, n in mine[k]), dtype=torch.uint8)
                sends = [(p, data) for p in to]
            taking = [(r, m[k], torch.empty(sum(n for _, _, n in m[k]), dtype=torch.uint8))
                      for r, m in zip(receivers, theirs) if k < len(m)]
            send(sends, [(r.sender, buf) for r, _, buf in taking])
            for r, segments, buf in taking:
                try:
                    r.take(segments, buf)
                except Exception as e:  # noqa: BLE001 - later rounds still run
                    failure = failure or e
        reports = []
        for r in receivers:
            try:
                reports += r.finish()
            except Exception as e:  # noqa: BLE001
                failure = failure or e
        if failure is not None:
            raise failure
        return reports
    finally:
        for r in receivers:
            r.close()
