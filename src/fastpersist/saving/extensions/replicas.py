"""Checking that replicated state is replicated (an extension of the save: :class:`ReplicaCheck`).

``state`` is written once for all ranks, each writer writing its share, so it must hold the same
bytes on every rank: otherwise the checkpoint would mix the ranks' values without an error.
Before the commit each rank hashes the replicated bytes it holds (xxh3-64 per storage, in a
thread that runs while the rank's writes do: xxhash releases the GIL) and the ranks compare the
digests; a difference fails the save on every rank, naming the first differing tensor.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from fastpersist.errors import ReplicaMismatchError
from fastpersist.format import torchzip
from fastpersist.io.buffers import memory_view
from fastpersist.objects import dtensor
from fastpersist.objects.write import Prepared
from fastpersist.saving.extension import Beside, Extension, Writer, Written, parts_of, run_beside
from fastpersist.saving.messages import RankReport, SavePlan, chunk_key

if TYPE_CHECKING:
    from fastpersist.saving.job import SaveJob

_DEVICE_CHUNK = 64 << 20  # device storages are hashed through host copies of this size


def storage_digest(storage: torch.UntypedStorage) -> int:
    n = storage.nbytes()
    if storage.device.type == "cpu":
        return xxhash.xxh3_64_intdigest(memory_view(storage.data_ptr(), n))
    h = xxhash.xxh3_64()
    view = torchzip.byte_view(storage)
    for start in range(0, n, _DEVICE_CHUNK):
        h.update(view[start : start + _DEVICE_CHUNK].cpu().numpy().tobytes())
    return h.intdigest()


def tensor_digest(t: torch.Tensor) -> int:
    """xxh3-64 of a contiguous tensor's bytes."""
    nbytes = t.numel() * t.element_size()
    if t.device.type == "cpu":
        return xxhash.xxh3_64_intdigest(memory_view(t.data_ptr(), nbytes))
    return xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())


class ReplicaDigests:
    """Hashes every storage of ``prepared`` in a background thread; :meth:`result` waits."""

    def __init__(self, prepared: Prepared) -> None:
        self._storages = list(prepared.storages)
        self._digests: list[int] = []
        self._error: BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="fastpersist-replica-hash", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            self._digests = [storage_digest(s) for s in self._storages]
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e
        self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        self._thread.join()

    def result(self) -> list[int]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._digests


def _paths(obj: Any, prefix: str, out: dict[int, str]) -> None:
    """The first path (``model.layers.0.weight``) at which each storage appears in ``obj``."""
    if isinstance(obj, torch.Tensor):
        out.setdefault(obj.untyped_storage().data_ptr(), prefix or "<state>")
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _paths(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _paths(v, f"{prefix}.{i}" if prefix else str(i), out)


def storage_name(prepared: Prepared, index: int, state: Any) -> str:
    """A name for storage ``index``: the key path of a tensor on it, else its index and size."""
    paths: dict[int, str] = {}
    _paths(state, "", paths)
    s = prepared.storages[index]
    found = paths.get(s.data_ptr()) if s.nbytes() else None
    return f"state[{found!r}]" if found else f"storage #{index} ({s.nbytes()} bytes)"


def check_replicas(step: int, digests: Sequence[list[int] | None], prepared: Prepared, state: Any) -> None:
    """Raise :class:`ReplicaMismatchError` (on every rank alike: every rank sees every rank's
    digests) if some rank's replicated bytes differ from the lowest rank's."""
    base = digests[0]
    if base is None:
        return
    first: int | None = None
    ranks: list[int] = []
    for r, d in enumerate(digests[1:], start=1):
        if d is None or d == base:
            continue
        i = next(k for k, (a, b) in enumerate(zip(base, d)) if a != b)
        if first is None or i < first:
            first = i
        ranks.append(r)
    if first is None:
        return
    name = storage_name(prepared, first, state)
    raise ReplicaMismatchError(
        f"checkpoint step {step}: the replicated state holds different values on different ranks: {name} on "
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} differs from rank 0 (and so may "
        "more). `state` is written once for all ranks, so nothing was committed. If this state is sharded "
        "(ZeRO, FSDP, tensor parallel) or otherwise per rank, pass each rank's part as rank_state=...; if the "
        "ranks really should agree, they have diverged. Jobs that guarantee replication can skip this check "
        "with Checkpointer(check_replicated=False)",
        name, ranks,
    )


def check_replicated_chunks(step: int, digests: Sequence[dict[int, int]], keys: Sequence[str]) -> None:
    """Raise :class:`ReplicaMismatchError` if the holders of a replicated shard (a DTensor chunk
    held by several ranks, written once and split over them) hold different bytes. ``digests``
    maps, per rank, chunk index -> xxh3-64 of its local copy; ``keys`` names each chunk."""
    seen: dict[int, tuple[int, int]] = {}  # chunk -> (first holder, its digest)
    for rank, mine in enumerate(digests):
        for c, d in sorted(mine.items()):
            first = seen.setdefault(c, (rank, d))
            if first[1] != d:
                raise ReplicaMismatchError(
                    f"checkpoint step {step}: the shard of sharded tensor {keys[c]!r} replicated over a mesh "
                    f"dimension holds different values on rank {rank} and rank {first[0]}; it is written once for "
                    "its replica group, so nothing was committed. The ranks have diverged (or this DTensor's "
                    "placement says Replicate where the values differ). Jobs that guarantee replication can skip "
                    "this check with Checkpointer(check_replicated=False)",
                    keys[c], [rank],
                )


class ReplicaCheck(Extension):
    """The replica check as an extension of the save: every rank hashes the replicated bytes it
    holds (and the DTensor chunks it holds with other ranks) beside its writes; once every
    rank's digests are known, every rank compares them, before the commit."""

    name = "replicas"
    option = "check_replicated"

    def beside_write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Beside:
        hashing = ReplicaDigests(plan.replicated)  # started now, on its own thread
        shards, layout = job.shards, plan.layout

        def digests() -> Written:
            try:
                chunks = chunk_digests(shards, layout)
                storages = hashing.result()
            finally:
                hashing.join()
            job.metrics.replica_check_s = hashing.seconds
            return Written(part=(storages, chunks))

        return run_beside(self.name, digests)

    def check(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport]) -> None:
        parts = parts_of(written, self.name)
        check_replicas(job.step, [p[0] if p is not None else None for p in parts], plan.replicated, job.state)
        check_replicated_chunks(job.step, [p[1] if p is not None else {} for p in parts],
                                [c.key for c in plan.layout.chunks])


def chunk_digests(shards: Sequence[dtensor.LocalShard], layout: dtensor.Layout) -> dict[int, int]:
    """xxh3-64 of every shard this rank holds that other ranks hold too (the replica check)."""
    index = {chunk_key(c): i for i, c in enumerate(layout.chunks)}
    out = {}
    for sh in shards:
        c = index.get(chunk_key(sh.meta))
        if c is not None and len(layout.holders[c]) > 1:
            out[c] = tensor_digest(sh.tensor)
    return out
