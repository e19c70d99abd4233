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

from fastpersist import catalog
from fastpersist.dist import Comm
from fastpersist.errors import CheckpointError, CheckpointNotFoundError, CheckpointReadError, CorruptCheckpointError
from fastpersist.format import copies
from fastpersist.format import manifest as mf
from fastpersist.io.backend import FileBackend
from fastpersist.io.buffers import memory_view
from fastpersist.io.reader import ReadFailedError
from fastpersist.nodes import Nodes

T = TypeVar("T")

logger = logging.getLogger(__name__)

BATCH_BYTES = 64 << 20  # one broadcast moves at most this much (or one larger extent)
MAX_ROUNDS = 4  # load attempts with damaged copies excluded before the load fails
STAGING = ".fastpersist-tmp-peer-"  # a clean start removes what a crash left


@dataclass(frozen=True)
class Holding:
    """What one node holds of one step: its files' sizes by (root, name), and its manifest."""

    files: dict[tuple[int, str], int]
    manifest: bytes | None


def inventory(roots: Sequence[str], backend: FileBackend) -> dict[int, Holding]:
    """A node leader's inventory of its roots (best effort: what cannot be listed is absent)."""
    out: dict[int, Holding] = {}
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
                    st = os.lstat(os.path.join(d, f))
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and mf.valid_file_name(f):
                    files[(j, f)] = st.st_size
        raw = None
        if entry.committed:
            try:
                raw = backend.read_small(os.path.join(entry.path, mf.MANIFEST_NAME), mf.MAX_MANIFEST_BYTES, "manifest")
            except CheckpointError as e:
                logger.warning("%s", e)
        out[entry.step] = Holding(files, raw)
    return out


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

    def __init__(self, comm: Comm, nodes: Nodes, roots: Sequence[str], backend: FileBackend) -> None:
        self.comm = comm
        self.nodes = nodes
        self.roots = list(roots)
        self.backend = backend
        self.node = nodes.of_rank[comm.rank]
        self.leader = nodes.is_leader(comm.rank)

    def _gather(self) -> tuple[dict[int, list[Holding | None]], str]:
        """Everyone's inventory, by step then node; and a token rank 0 chose for this restore."""
        mine = inventory(self.roots, self.backend) if self.leader else None
        token = secrets.token_hex(4) if self.comm.rank == 0 else ""
        gathered = self.comm.all_gather((mine, token), "control")
        by_step: dict[int, list[Holding | None]] = {}
        for rank, (inv, _) in enumerate(gathered):
            for step, h in (inv or {}).items():
                by_step.setdefault(step, [None] * self.nodes.count)[self.nodes.of_rank[rank]] = h
        return by_step, gathered[0][1]

    def _candidates(self, by_step: dict[int, list[Holding | None]]) -> list[_Step]:
        """Every committed step (its most recent manifest), most recent commit first."""
        out = []
        for step, held in by_step.items():
            best: mf.Manifest | None = None
            for n, h in enumerate(held):
                if h is None or h.manifest is None:
                    continue
                try:
                    m = mf.parse(f"{catalog.step_dir(step)}/{mf.MANIFEST_NAME} on node {self.nodes.ids[n]}", h.manifest)
                except CheckpointError as e:
                    logger.warning("%s", e)
                    continue
                if best is None or (m.sequence, m.created) > (best.sequence, best.created):
                    best = m
            if best is None:
                continue
            holders = [{n for n, h in enumerate(held) if h is not None and h.files.get((f.root, f.name), -1) >= f.size}
                       for f in best.files]
            out.append(_Step(best, holders))
        return sorted(out, key=lambda s: (s.manifest.sequence, s.manifest.created, s.manifest.step), reverse=True)

    def resolve(self, step: int | str) -> tuple[_Step | None, str]:
        """The step to load (collective): see the module's step 2. None when the nodes hold no
        complete commit and ``step`` is "latest"."""
        by_step, token = self._gather()
        cands = self._candidates(by_step)
        if step != "latest":
            mine = [c for c in cands if c.manifest.step == step]
            if not mine:
                raise CheckpointNotFoundError(f"no node of this job holds a committed checkpoint step {step} "
                                              f"(under {self.roots[0]} on each node)")
            missing = mine[0].complete(set())
            if missing:
                older = next((c.manifest.step for c in cands if c.manifest.sequence < mine[0].manifest.sequence
                              and not c.complete(set())), None)
                raise CheckpointReadError(
                    f"checkpoint step {step} cannot be restored from this job's nodes ({', '.join(self.nodes.ids)}): "
                    f"{copies.describe_missing(mine[0].manifest, missing)} have no copy on any of them; "
                    + (f"step {older} is the newest complete one" if older is not None else "no older step is complete"))
            return mine[0], token
        for c in cands:
            missing = c.complete(set())
            if not missing:
                return c, token
            logger.warning("checkpoint step %d is not complete on this job's nodes (%s); trying an older one",
                           c.manifest.step, copies.describe_missing(c.manifest, missing))
        return None, token

    def load(self, step: int | str, read: Callable[[list[str], mf.Manifest], T]) -> T:
        """Restore ``step`` (collective; see the module) and return ``read(dirs, manifest)`` on
        this rank, where ``manifest`` lists this node's copies and the staged files."""
        chosen, token = self.resolve(step)
        if chosen is None:
            raise CheckpointNotFoundError(f"no complete committed checkpoint on this job's nodes "
                                          f"({', '.join(self.nodes.ids)}) under {self.roots[0]}")
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
                outcome: tuple[str, Any] = ("ok", None)
                error: BaseException | None = None
                dirs = self._dirs(m.step, staging)
                try:
                    result = read(dirs, local)
                except (CorruptCheckpointError, ReadFailedError) as e:
                    outcome = ("damaged", (self._damaged(dirs, local, plan), str(e)))
                except Exception as e:  # noqa: BLE001 - every rank must hear of it
                    outcome, error = ("failed", f"{type(e).__name__}: {e}"), e
                outcomes = self.comm.all_gather(outcome, "control")
                failed = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] == "failed"]
                if failed:
                    if error is not None:
                        raise error
                    raise CheckpointReadError(f"restoring checkpoint step {m.step} failed on rank {failed[0][0]}: "
                                              f"{failed[0][1]}")
                damaged = {loc for o in outcomes if o[0] == "damaged" for loc in o[1][0]}
                if not damaged:
                    if any(o[0] == "damaged" for o in outcomes):
                        first = next(o[1][1] for o in outcomes if o[0] == "damaged")
                        raise CorruptCheckpointError(f"restoring checkpoint step {m.step}: {first}")
                    return result
                logger.warning("checkpoint step %d: damaged copies in %s; loading those bytes from other copies "
                               "(attempt %d)", m.step, ", ".join(sorted(m.files[f].name for f, _ in damaged)),
                               attempt + 2)
                bad |= damaged
            raise CorruptCheckpointError(f"checkpoint step {m.step}: still damaged after {MAX_ROUNDS} attempts")
        finally:
            if self.leader and os.path.isdir(staging):
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
        """Step 3: every transfer of ``plan``, batched per source rank; returns the (file, node)
        copies found damaged (at the sender or at a receiver), known alike on every rank."""
        import torch

        bad: set[tuple[int, int]] = set()
        receiving = self.leader and any(self.node in t.dests for t in plan.transfers)
        if receiving:
            self.backend.makedirs(staging)
        handles: dict[int, int] = {}
        try:
            for src_node, batch in plan.batches(BATCH_BYTES):
                src = self.nodes.ranks(src_node)[0]
                size = sum(t.nbytes for t in batch)
                buf = torch.empty(len(batch) + size, dtype=torch.uint8)
                if self.comm.rank == src:
                    self._read_batch(batch, buf, m)
                broadcast = getattr(self.comm, "broadcast")
                broadcast(buf, src, "control")
                view = memory_view(buf.data_ptr(), buf.numel())
                pos = len(batch)
                for k, t in enumerate(batch):
                    data = view[pos : pos + t.nbytes]
                    pos += t.nbytes
                    if buf[k].item() != 1:
                        bad.add((t.file, src_node))
                        continue
                    if receiving and self.node in t.dests:
                        if xxhash.xxh3_64_intdigest(data) != t.checksum:
                            bad.add((t.file, src_node))
                            continue
                        self._stage(handles, staging, m, t.file, t.offset, data)
        finally:
            for fd in handles.values():
                os.close(fd)
        # damage seen at a receiver is known there only: tell everyone
        return {loc for found in self.comm.all_gather(sorted(bad), "control") for loc in found}

    def _read_batch(self, batch: Sequence[_Transfer], buf: Any, m: mf.Manifest) -> None:
        """At the source: read each extent, check it; flag byte 1 = good, 0 = damaged or unreadable."""
        view = memory_view(buf.data_ptr(), buf.numel())
        pos = len(batch)
        for k, t in enumerate(batch):
            entry = m.files[t.file]
            path = os.path.join(self.roots[entry.root], catalog.step_dir(m.step), entry.name)
            ok = 0
            try:
                file = self.backend.open_read(path, "off")
                try:
                    got = os.preadv(file.fd, [view[pos : pos + t.nbytes]], t.offset)
                finally:
                    file.close()
                ok = int(got == t.nbytes and xxhash.xxh3_64_intdigest(view[pos : pos + t.nbytes]) == t.checksum)
            except (OSError, CheckpointError) as e:
                logger.warning("checkpoint step %d: cannot read %s for another node: %s", m.step, path, e)
            if not ok:
                logger.warning("checkpoint step %d: bytes %d..%d of %s are damaged; another copy is used",
                               m.step, t.offset, t.offset + t.nbytes, path)
            view[k] = ok
            pos += t.nbytes

    def _stage(self, handles: dict[int, int], staging: str, m: mf.Manifest, f: int, offset: int,
               data: memoryview) -> None:
        """At a receiving node's leader: write received bytes at their offset of the staged file."""
        if f not in handles:
            path = os.path.join(staging, m.files[f].name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            os.ftruncate(fd, m.files[f].size)
            handles[f] = fd
        done = 0
        while done < len(data):
            done += os.pwrite(handles[f], data[done:], offset + done)


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

    def batches(self, limit: int) -> list[tuple[int, list[_Transfer]]]:
        """Transfers grouped by source node, each group at most ``limit`` bytes (or one extent)."""
        out: list[tuple[int, list[_Transfer]]] = []
        for src in sorted({t.src for t in self.transfers}):
            group: list[_Transfer] = []
            size = 0
            for t in (t for t in self.transfers if t.src == src):
                if group and size + t.nbytes > limit:
                    out.append((src, group))
                    group, size = [], 0
                group.append(t)
                size += t.nbytes
            if group:
                out.append((src, group))
        return out
