"""Restoring a checkpoint of a job on several nodes, where each rank can open only its own node's
disks: the restore protocol (collective, on the Checkpointer's own process group).

1. **Inventory.** Every node's leader lists what its roots hold: each step directory's files
   with their sizes and, where it has one, the manifest. Everyone gathers everyone's.
2. **Agree.** Every rank picks alike: the requested step, or for ``"latest"`` the most recent
   commit (by sequence) that is *complete somewhere*: each of its extents has a copy in a file
   that some node holds at its full size. An incomplete ``"latest"`` falls back to the next older
   commit (logged); an incomplete requested step fails on every rank, naming the missing extents,
   the files and nodes they were written on, and the newest complete step.
3. **Move.** For every node, each extent it holds no copy of is read by a rank of a node that
   does (sources balanced by bytes), checked against its checksum there, broadcast, checked
   again at the receiving node and written into a private staging directory in that node's first
   root, at the same offset of a file of the same name (a sparse file).
4. **Load.** Every rank loads with the ordinary loader from a manifest rewritten to its node's
   copies and the staged files (every checksum verified as always). A copy found damaged on
   either side (at the sender, at the receiver, or by a rank's load) is excluded and its bytes
   are taken from another copy in another round; only when no copy is left does the load fail.
5. The staging directories are removed (a crash leaves them to the next clean start).

No byte moves for extents a node holds itself: with ``redundancy`` equal to the number of nodes,
every node loads alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import stat
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import xxhash

from fastpersist.storage import catalog
from fastpersist.dist import Comm
from fastpersist.errors import (CheckpointError, CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError,
                               IncompleteCheckpointError)
from fastpersist.loading.view import resolve_step
from fastpersist.format import copies
from fastpersist.format import manifest as mf
from fastpersist.storage.backend import FileBackend
from fastpersist.io.buffers import memory_view
from fastpersist.io.files import DirectFile
from fastpersist.io.reader import ReadFailedError
from fastpersist.topology import NodeMap

T = TypeVar("T")

logger = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20  # one broadcast moves at most this much (or one larger extent)
MAX_ROUNDS = 4  # load attempts with damaged copies excluded before the load fails
STAGING = ".fastpersist-tmp-peer-"  # a clean start removes what a crash left


@dataclass(frozen=True)
class _ReadOutcome:
    """One rank's read of a restored checkpoint, told to every rank (one all-gather)."""

    kind: str  # "ok", "damaged" (a checksum failed: ``damaged`` names the copies) or "failed"
    message: str = ""
    damaged: frozenset[tuple[int, int]] = frozenset()  # the damaged copies (file, extent) this rank found


@dataclass(frozen=True)
class Holding:
    """What one node holds of one step: its files' sizes by (root, name), and the commit its
    manifest records ((sequence, created); None: no readable manifest there)."""

    files: dict[tuple[int, str], int]
    commit: tuple[int, float] | None


def inventory(roots: Sequence[str], backend: FileBackend) -> tuple[dict[int, Holding], dict[int, bytes]]:
    """A node leader's inventory of its roots (what cannot be listed is absent), and the raw
    manifests it found (kept here; sent only when the nodes pick one)."""
    out: dict[int, Holding] = {}
    raws: dict[int, bytes] = {}
    for entry in catalog.scan(roots[0], backend):
        files: dict[tuple[int, str], int] = {}
        name = catalog.step_dir(entry.step)
        for j, root in enumerate(roots):
            d = os.path.join(root, name)
            try:
                names = backend.listdir(d)
            except OSError:
                continue
            for f in names:
                try:
                    st = backend.stat(os.path.join(d, f), follow=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and mf.valid_file_name(f):
                    files[(j, f)] = st.st_size
        commit = None
        if entry.committed:
            try:
                raw = backend.read_small(os.path.join(entry.path, mf.MANIFEST_NAME), mf.MAX_MANIFEST_BYTES, "manifest")
                m = mf.parse(os.path.join(entry.path, mf.MANIFEST_NAME), raw)
                raws[entry.step], commit = raw, (m.sequence, m.created)
            except CheckpointError as e:
                logger.warning("%s", e)
        out[entry.step] = Holding(files, commit)
    return out, raws


@dataclass
class _Step:
    """One candidate step: its manifest and which nodes hold each of its files."""

    manifest: mf.Manifest
    holders: list[set[int]]  # per file index: the nodes holding it whole

    def complete(self, bad: set[tuple[int, int]]) -> list[tuple[str, mf.ExtentEntry]]:
        """The extents with no usable copy anywhere (``bad``: (file, node) pairs excluded)."""
        return [(what, e) for what, e in copies.extents(self.manifest)
                if not any((f, n) not in bad for f, _ in e.locations() for n in self.holders[f])]


class PeerRestore:
    """The restore protocol for one Checkpointer (see the module)."""

    def __init__(self, comm: Comm, nodes: NodeMap, roots: Sequence[str], backend: FileBackend) -> None:
        self.comm = comm
        self.nodes = nodes
        self.roots = list(roots)
        self.backend = backend
        self.node = nodes.of_rank[comm.rank]
        self.leader = nodes.is_leader(comm.rank)
        self._held: dict[int, list[Holding | None]] = {}
        self._raws: dict[int, bytes] = {}

    def _gather(self) -> str:
        """Everyone's inventory (kept by step, then node); returns a token rank 0 chose for this
        restore. A leader that cannot list its roots holds nothing, as far as the others know."""
        mine = None
        self._raws = {}
        if self.leader:
            try:
                mine, self._raws = inventory(self.roots, self.backend)
            except (OSError, CheckpointError) as e:
                logger.warning("cannot list this node's roots under %s (%s): restoring from the other nodes",
                               self.roots[0], e)
        token = secrets.token_hex(4) if self.comm.rank == 0 else ""
        gathered = self.comm.all_gather((mine, token), "control")
        self._held = {}
        for rank, (inv, _) in enumerate(gathered):
            for step, h in (inv or {}).items():
                self._held.setdefault(step, [None] * self.nodes.count)[self.nodes.of_rank[rank]] = h
        return str(gathered[0][1])

    def _commit_of(self, step: int) -> tuple[int, float]:
        return max((h.commit for h in self._held[step] if h is not None and h.commit is not None), default=(-1, 0.0))

    def _fetch(self, step: int, node: int) -> mf.Manifest | None:
        """``node``'s manifest of ``step``, sent by its leader to every rank (collective)."""
        import torch

        leader = self.nodes.leader(node)
        raw = self._raws.get(step) if self.comm.rank == leader else None
        size = int(self.comm.all_gather(len(raw) if raw is not None else -1, "control")[leader])
        if size < 0:
            return None
        buf = torch.empty(size, dtype=torch.uint8)
        if raw is not None:
            buf.copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        self._broadcast(buf, leader)
        where = f"{catalog.step_dir(step)}/{mf.MANIFEST_NAME} on node {self.nodes.ids[node]}"
        try:
            return mf.parse(where, bytes(memory_view(buf.data_ptr(), size)))
        except CheckpointError as e:
            logger.warning("%s", e)
            return None

    def _broadcast(self, buf: Any, src: int) -> None:
        broadcast = getattr(self.comm, "broadcast", None)
        if broadcast is None:
            raise CheckpointReadError("restoring across nodes needs a comm with broadcast() (fastpersist.dist.GlooComm)")
        broadcast(buf, src, "control")

    def _step(self, step: int) -> _Step | None:
        """``step`` with the manifest of its most recent commit among the nodes (collective)."""
        held = self._held.get(step, [])
        order = sorted((h.commit, n) for n, h in enumerate(held) if h is not None and h.commit is not None)
        for _, n in reversed(order):
            m = self._fetch(step, n)
            if m is not None:
                holders = [{k for k, h in enumerate(held) if h is not None and h.files.get((f.root, f.name), -1) >= f.size}
                           for f in m.files]
                return _Step(m, holders)
        return None

    def _by_recency(self) -> list[int]:
        return sorted((s for s in self._held if self._commit_of(s)[0] >= 0),
                      key=lambda s: (*self._commit_of(s), s), reverse=True)

    def resolve(self, step: int | str, complete: bool = True) -> tuple[_Step | None, str]:
        """The step to load (collective): see the module's step 2. None when the nodes hold no
        (complete, unless ``complete`` is False) commit and ``step`` is "latest"."""
        token = self._gather()
        if step != "latest":
            wanted = resolve_step(self.roots[0], step)
            chosen = self._step(wanted)
            if chosen is None:
                raise CheckpointNotFoundError(f"no node of this job holds a committed checkpoint step {wanted} "
                                              f"(under {self.roots[0]} on each node)")
            missing = chosen.complete(set()) if complete else []
            if missing:
                older = next((s for s in self._by_recency() if self._commit_of(s) < self._commit_of(wanted)
                              and (c := self._step(s)) is not None and not c.complete(set())), None)
                raise IncompleteCheckpointError(
                    f"checkpoint step {wanted} cannot be restored from this job's nodes ({', '.join(self.nodes.ids)}): "
                    f"{copies.describe_missing(chosen.manifest, missing)} have no copy on any of them; "
                    + (f"step {older} is the newest complete one" if older is not None else "no older step is complete"))
            return chosen, token
        for s in self._by_recency():
            chosen = self._step(s)
            if chosen is None:
                continue
            missing = chosen.complete(set()) if complete else []
            if not missing:
                return chosen, token
            logger.warning("checkpoint step %d is not complete on this job's nodes (%s); trying an older one",
                           s, copies.describe_missing(chosen.manifest, missing))
        return None, token

    def share(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank (collective): what one rank saw of something outside
        the job (the durable tier) decides for all."""
        return self.comm.all_gather(value if self.comm.rank == 0 else None, "control")[0]

    def load(self, step: int | str, read: Callable[[list[str], mf.Manifest], T], newer: int = -1) -> T:
        """Restore ``step`` (collective; see the module) and return ``read(dirs, manifest)`` on
        this rank, where ``manifest`` lists this node's copies and the staged files. For
        "latest", a commit whose sequence is not above ``newer`` (the durable tier's latest) is
        not taken: CheckpointNotFoundError."""
        chosen, token = self.resolve(step)
        if chosen is None or (step == "latest" and chosen.manifest.sequence <= newer):
            raise CheckpointNotFoundError(f"no complete committed checkpoint on this job's nodes "
                                          f"({', '.join(self.nodes.ids)}) under {self.roots[0]}"
                                          + (" more recent than the durable tier's" if newer >= 0 else ""))
        m = chosen.manifest
        staging = os.path.join(self.roots[0], f"{STAGING}{token}")
        bad: set[tuple[int, int]] = set()
        try:
            for attempt in range(MAX_ROUNDS):
                missing = chosen.complete(bad)
                if missing:
                    raise CorruptCheckpointError(
                        f"checkpoint step {m.step}: {copies.describe_missing(m, missing)} have no undamaged copy on "
                        f"this job's nodes ({', '.join(self.nodes.ids)})")
                plan = _Transfers(chosen, bad, self.nodes.count)
                bad |= self._move(plan, staging, m)
                if bad & plan.sources():
                    continue  # a copy was found damaged in flight: take those bytes from another copy
                local = self._localized(chosen, bad, plan)
                outcome = _ReadOutcome("ok")
                error: BaseException | None = None
                dirs = self._dirs(m.step, staging)
                try:
                    result = read(dirs, local)
                except (CorruptCheckpointError, ReadFailedError) as e:
                    outcome = _ReadOutcome("damaged", str(e), frozenset(self._damaged(dirs, local, plan)))
                except Exception as e:  # noqa: BLE001 - every rank must hear of it
                    outcome, error = _ReadOutcome("failed", f"{type(e).__name__}: {e}"), e
                outcomes: list[_ReadOutcome] = self.comm.all_gather(outcome, "control")
                failed = [(r, o.message) for r, o in enumerate(outcomes) if o.kind == "failed"]
                if failed:
                    if error is not None:
                        raise error
                    raise CheckpointReadError(f"restoring checkpoint step {m.step} failed on rank {failed[0][0]}: "
                                              f"{failed[0][1]}")
                damaged = {loc for o in outcomes if o.kind == "damaged" for loc in o.damaged}
                if not damaged:
                    if any(o.kind == "damaged" for o in outcomes):
                        first = next(o.message for o in outcomes if o.kind == "damaged")
                        raise CorruptCheckpointError(f"restoring checkpoint step {m.step}: {first}")
                    return result
                logger.warning("checkpoint step %d: damaged copies in %s; loading those bytes from other copies "
                               "(attempt %d)", m.step, ", ".join(sorted(m.files[f].name for f, _ in damaged)),
                               attempt + 2)
                bad |= damaged
            raise CorruptCheckpointError(f"checkpoint step {m.step}: still damaged after {MAX_ROUNDS} attempts")
        finally:
            if self.leader and self.backend.is_dir(staging):
                self.backend.rmtree(staging, lambda p, e: logger.warning("could not remove %s: %s", p, e))

    def _dirs(self, step: int, staging: str) -> list[str]:
        name = catalog.step_dir(step)
        return [os.path.join(r, name) for r in self.roots] + [staging]

    def _localized(self, chosen: _Step, bad: set[tuple[int, int]], plan: _Transfers) -> mf.Manifest:
        """The manifest as this node reads it: each extent at this node's undamaged copy, else
        in the staged copy of the file it was received from (root index = one past the roots)."""
        node = self.node
        m = chosen.manifest

        def choose(e: mf.ExtentEntry) -> copies.Location | None:
            for f, off in e.locations():
                if node in chosen.holders[f] and (f, node) not in bad:
                    return f, off
            return plan.source_of.get((e.file, e.offset, node))

        local, _ = copies.localize(m, choose)
        staged = {f for f, _ in plan.staged_files(node)}
        files = tuple(dataclasses.replace(f, root=len(self.roots)) if i in staged else f for i, f in enumerate(m.files))
        return dataclasses.replace(local, files=files, roots=len(self.roots) + 1)

    def _damaged(self, dirs: list[str], local: mf.Manifest, plan: _Transfers) -> set[tuple[int, int]]:
        """After a load found damage: which copies it used are damaged (verify reads them again
        and names each bad extent's file): a file of this node, or a staged file (its source's)."""
        from fastpersist.objects import verify as objverify

        problems, _ = objverify.verify(dirs, local, backend=self.backend)
        paths = {p.path for p in problems}
        src = {f: n for f, n in plan.staged_files(self.node)}
        out = set()
        for i, f in enumerate(local.files):
            if os.path.join(dirs[f.root], f.name) in paths:
                out.add((i, src[i]) if f.root == len(self.roots) else (i, self.node))
        return out

    def _move(self, plan: _Transfers, staging: str, m: mf.Manifest) -> set[tuple[int, int]]:
        """Step 3: every transfer of ``plan``, in pieces of at most BATCH_BYTES batched per source
        node; returns the (file, node) copies found damaged (at the sender or at a receiver),
        known alike on every rank. A rank that fails to stage what it receives keeps taking part
        to the end, then every rank raises."""
        import torch

        bad: set[tuple[int, int]] = set()
        receiving = self.leader and any(self.node in t.dests for t in plan.transfers)
        failure: str | None = None
        handles: dict[int, DirectFile] = {}
        hashes: dict[int, Any] = {}  # transfer index -> xxh3 state of what arrived so far
        try:
            if receiving:
                try:
                    self.backend.makedirs(staging)
                except OSError as e:
                    failure = f"cannot create {staging}: {e.strerror or e}"
            for src_node, batch in plan.batches(BATCH_BYTES):
                src = self.nodes.ranks(src_node)[0]
                size = sum(n for _, _, n in batch)
                buf = torch.empty(size + len(batch), dtype=torch.uint8)  # the pieces, then one flag each
                if self.comm.rank == src:
                    self._read_batch(plan, batch, buf, m)
                self._broadcast(buf, src)
                view = memory_view(buf.data_ptr(), buf.numel())
                pos = 0
                for k, (i, off, n) in enumerate(batch):
                    t, data, flag = plan.transfers[i], view[pos : pos + n], view[size + k]
                    pos += n
                    if flag == _DAMAGED:
                        bad.add((t.file, src_node))
                    if not (receiving and self.node in t.dests) or (t.file, src_node) in bad or failure is not None:
                        continue
                    hashes.setdefault(i, xxhash.xxh3_64()).update(data)
                    if off + n == t.nbytes and hashes.pop(i).intdigest() != t.checksum:
                        bad.add((t.file, src_node))  # damaged on the way: another copy next round
                        continue
                    try:
                        _stage(self.backend, handles, staging, m, t.file, t.offset + off, data)
                    except OSError as e:
                        failure = f"writing {os.path.join(staging, m.files[t.file].name)}: {e.strerror or e}"
        finally:
            for file in handles.values():
                file.close()
        # damage seen at a receiver, and failures, are known there only: tell everyone
        gathered = self.comm.all_gather((sorted(bad), failure), "control")
        failed = [(r, f) for r, (_, f) in enumerate(gathered) if f is not None]
        if failed:
            raise CheckpointReadError(f"restoring checkpoint step {m.step}: rank {failed[0][0]} could not stage the "
                                      f"bytes it received: {failed[0][1]}")
        return {tuple(loc) for found, _ in gathered for loc in found}  # type: ignore[misc]

    def _read_batch(self, plan: _Transfers, batch: Sequence[tuple[int, int, int]], buf: Any, m: mf.Manifest) -> None:
        """At the source: read each piece; the flag of an extent's last piece says whether the
        whole extent matched its checksum (_GOOD) or not (_DAMAGED); other pieces: _MORE."""
        view = memory_view(buf.data_ptr(), buf.numel())
        size = buf.numel() - len(batch)
        pos = 0
        for k, (i, off, n) in enumerate(batch):
            t = plan.transfers[i]
            entry = m.files[t.file]
            path = os.path.join(self.roots[entry.root], catalog.step_dir(m.step), entry.name)
            ok = i not in plan.failed_here
            if ok:
                try:
                    file = self.backend.open_read(path, "off")
                    try:
                        got = self.backend.read_into(file, view[pos : pos + n], t.offset + off)
                    finally:
                        file.close()
                    ok = got == n
                    state = plan.sending.setdefault(i, xxhash.xxh3_64())
                    state.update(view[pos : pos + n])
                except (OSError, CheckpointError) as e:
                    logger.warning("checkpoint step %d: cannot read %s for another node: %s", m.step, path, e)
                    ok = False
            if ok and off + n == t.nbytes:
                ok = plan.sending.pop(i).intdigest() == t.checksum
                if not ok:
                    logger.warning("checkpoint step %d: bytes %d..%d of %s are damaged; another copy is used",
                                   m.step, t.offset, t.offset + t.nbytes, path)
            if not ok:
                plan.failed_here.add(i)
            view[size + k] = _GOOD if ok and off + n == t.nbytes else _MORE if ok else _DAMAGED
            pos += n

_GOOD, _MORE, _DAMAGED = 1, 2, 0  # a piece's flag


def _stage(backend: FileBackend, handles: dict[int, DirectFile], staging: str, m: mf.Manifest, f: int, offset: int,
           data: memoryview) -> None:
    """At a receiving node's leader: write received bytes at their offset of the staged file (a
    sparse file of the listed size, in the staging directory of the first root), through the
    file seam."""
    if f not in handles:
        path = os.path.join(staging, m.files[f].name)
        file = backend.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, "off", 0, mode=0o600)
        handles[f] = file
        backend.truncate(file, m.files[f].size)
    backend.pwrite(handles[f], data, offset)


@dataclass(frozen=True)
class _Transfer:
    """One extent's copy at (file, offset) of ``src`` node, sent to the nodes ``dests``."""

    file: int
    offset: int
    nbytes: int
    checksum: int
    src: int
    dests: frozenset[int]


class _Transfers:
    """Which node sends which extent to which nodes (the same on every rank): each extent a node
    holds no undamaged copy of comes from the node holding a copy that has sent the fewest bytes
    so far."""

    def __init__(self, chosen: _Step, bad: set[tuple[int, int]], nodes: int) -> None:
        self.transfers: list[_Transfer] = []
        self.sending: dict[int, Any] = {}  # at a source: transfer index -> xxh3 state of what it read
        self.failed_here: set[int] = set()  # at a source: transfers it could not read or found damaged
        self.source_of: dict[tuple[int, int, int], copies.Location] = {}  # (first file, offset, node) -> copy
        sent = [0] * nodes
        for _, e in copies.extents(chosen.manifest):
            usable = [(f, off, n) for f, off in e.locations() for n in sorted(chosen.holders[f]) if (f, n) not in bad]
            have = {n for _, _, n in usable}
            lacking = frozenset(n for n in range(nodes) if n not in have)
            if not lacking or not usable:
                continue
            f, off, src = min(usable, key=lambda u: (sent[u[2]], u[2]))
            sent[src] += e.nbytes
            self.transfers.append(_Transfer(f, off, e.nbytes, e.checksum, src, lacking))
            for n in lacking:
                self.source_of[(e.file, e.offset, n)] = (f, off)

    def sources(self) -> set[tuple[int, int]]:
        return {(t.file, t.src) for t in self.transfers}

    def staged_files(self, node: int) -> set[tuple[int, int]]:
        return {(t.file, t.src) for t in self.transfers if node in t.dests}

    def batches(self, limit: int) -> list[tuple[int, list[tuple[int, int, int]]]]:
        """Pieces (transfer index, offset in the extent, bytes) of at most ``limit`` bytes,
        grouped by source node into batches of at most ``limit`` bytes, in a fixed order."""
        out: list[tuple[int, list[tuple[int, int, int]]]] = []
        for src in sorted({t.src for t in self.transfers}):
            group: list[tuple[int, int, int]] = []
            size = 0
            for i, t in enumerate(self.transfers):
                if t.src != src:
                    continue
                for off in range(0, t.nbytes, limit):
                    n = min(limit, t.nbytes - off)
                    if group and size + n > limit:
                        out.append((src, group))
                        group, size = [], 0
                    group.append((i, off, n))
                    size += n
            if group:
                out.append((src, group))
        return out
