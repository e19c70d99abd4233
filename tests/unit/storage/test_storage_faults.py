"""The fault matrix reaches the paths that used to escape the file seam: a node's staging of
bytes restored from other nodes, the durable drain's reads of the local files it uploads, the
directory durable tier's own files, and the folder fsync of a directory save (publish).

Real files everywhere; the fault is injected through :class:`fastpersist.storage.faults.FaultyBackend`
at the operation and path where it belongs. Each test checks that the error names the file and
the cause, and that nothing committed is lost."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

import pytest
import torch
from cores import job, make_protocol

import fastpersist as fp
from fastpersist.errors import CheckpointError, CheckpointReadError, CheckpointWriteError
from fastpersist.dist import LocalComm
from fastpersist.options import Durable
from fastpersist.storage import catalog
from fastpersist.storage.faults import Fault, FaultyBackend, NodeLocal
from fastpersist.storage.publish import OLD_SUFFIX, PARTIAL_SUFFIX
from fastpersist.tiers.durable.extension import DurableDrain
from fastpersist.tiers.durable.store import DirStore, StoreError, open_store
from fastpersist.tiers.nodes.restore import STAGING

from helpers import assert_state_equal, per_rank, replicated, run_ranks
from node_sim import node_of, roots_of


# ---------------------------------------------------------------------------------------------
# peer restore: the staging files a node's leader writes


class FaultyNode(FaultyBackend):
    """A :class:`FaultyBackend` confined to one simulated node's disks: :class:`NodeLocal`'s
    check first (another node's path is EACCES), then the faults."""

    def __init__(self, base: str, node: str, faults: list[Fault]) -> None:
        super().__init__(faults)
        self.local = NodeLocal(base, node)

    def before_open(self, root: int, path: str) -> None:
        self.local.before_open(root, path)
        super().before_open(root, path)

    def before_read(self, path: str, offset: int | None, nbytes: int | None) -> None:
        self.local.before_read(path, offset, nbytes)
        super().before_read(path, offset, nbytes)

    def before_list(self, path: str) -> None:
        self.local.before_list(path)
        super().before_list(path)

    def before_delete(self, path: str) -> None:
        self.local.before_delete(path)
        super().before_delete(path)

    def before_lock(self, path: str) -> None:
        self.local.before_lock(path)
        super().before_lock(path)

    def before_link(self, root: int, src: str, dst: str) -> None:
        self.local.before_link(root, src, dst)
        super().before_link(root, src, dst)

    def before_mkdir(self, path: str) -> None:
        self.local.before_mkdir(path)
        super().before_mkdir(path)


def _checkpointer(base: str, rank: int, backend: Any) -> fp.Checkpointer:
    """Rank ``rank`` on node ``node<rank>`` (one rank per node), its own roots only."""
    node = node_of(rank, 1)
    os.environ["FASTPERSIST_NODE"] = node
    return fp.Checkpointer(roots_of(base, node), backend=backend, timeout_s=120)


def _save(rank: int, world: int, base: str) -> None:
    ck = _checkpointer(base, rank, NodeLocal(base, node_of(rank, 1)))
    ck.save(0, replicated(0), rank_state=per_rank(0, rank))
    ck.close()


def _restore(rank: int, world: int, base: str, faulty_rank: int | None) -> tuple[str | None, list[Any]]:
    """Load the latest checkpoint on every rank; ``faulty_rank``'s node cannot write its staging
    files (ENOSPC on the first write request to one). Returns the error and the faults fired."""
    node = node_of(rank, 1)
    faults = [Fault("write", errno.ENOSPC, path_contains=STAGING)] if rank == faulty_rank else []
    backend = FaultyNode(base, node, faults)
    ck = _checkpointer(base, rank, backend)
    try:
        got = ck.load("latest")
        assert_state_equal(got, replicated(0))
        assert_state_equal(ck.load_rank_state(rank=rank), per_rank(0, rank))
        return None, backend.fired
    except CheckpointReadError as e:
        return str(e), backend.fired
    finally:
        ck.close()


def test_a_staging_write_that_fails_fails_the_restore_on_every_rank(tmp_path: Any) -> None:
    """Regression: the staging files a node's leader writes while restoring from other nodes
    were written with os.open/os.ftruncate/os.pwrite, out of reach of the fault backend (the
    older test only failed the staging directory's creation, through a hand-made backend). Now
    an ENOSPC injected through FaultyBackend on a write request to a staging file fails the
    restore on every rank, naming the rank, the staging file and the cause, without a hang;
    the staging directory is removed and the checkpoint restores once the disk is back."""
    base = str(tmp_path / "nodes")
    run_ranks(tmp_path, 4, _save, base)
    results = run_ranks(tmp_path, 4, _restore, base, 2, timeout=240)
    errors = [e for e, _ in results]
    assert all(e is not None and "rank 2 could not stage" in e and "No space left on device" in e
               and "injected write fault" in e and STAGING in e for e in errors), errors
    fired = [f for _, f in results]
    assert [op for op, _ in fired[2]] == ["write"] and STAGING in fired[2][0][1]
    assert not any(fired[r] for r in (0, 1, 3))
    for r in range(4):  # every leader removed its staging directory
        assert not [n for n in os.listdir(roots_of(base, node_of(r, 1))[0]) if n.startswith(STAGING)]
    # nothing committed was lost: the same restore, without the fault, gives every rank its state
    assert [e for e, _ in run_ranks(tmp_path, 4, _restore, base, None, timeout=240)] == [None] * 4


# ---------------------------------------------------------------------------------------------
# the durable drain: reading the local files it uploads


def test_a_drain_read_that_fails_fails_that_drain_only(tmp_path: Any, caplog: Any) -> None:
    """Regression: the drain read the local files it uploads with os.open/os.pread, out of
    reach of the fault backend. Now an EIO injected through FaultyBackend on a read request to
    a local file of step 2 fails step 2's drain: its ``handle.durable`` raises an error naming
    the file and the cause, the failure is logged, the save itself and the local commit are
    untouched, the durable tier holds no committed copy of step 2, and steps 1 and 3 drain."""
    root, durable = str(tmp_path / "r"), str(tmp_path / "durable")
    step2 = os.path.join(root, catalog.step_dir(2)) + os.sep
    # 1: the drain opens the step's first file, 2: its first read request
    backend = FaultyBackend([Fault("read", errno.EIO, at=2, path_contains=step2)])
    ext = DurableDrain(open_store(durable), [root], 0, Durable(durable), "keep", 60.0, 0, backend)
    p = make_protocol(LocalComm(), [root], [ext], backend=backend)
    jobs = [job(s, {"w": torch.full((5000,), float(s))}, number=s) for s in (1, 2, 3)]
    with caplog.at_level(logging.WARNING, logger="fastpersist.tiers.durable.drain"):
        for j in jobs:
            p.run(j)
            j.completion.finish()
            j.handle.wait()  # the save itself succeeds
        p.close()  # finishes the drains in flight
    assert jobs[0].handle.durable.result(60) is True and jobs[2].handle.durable.result(60) is True
    with pytest.raises(CheckpointError, match=r"cannot read .*/step-00000002/.*\.bin at offset 0 to upload it: "
                                              r"Input/output error \(injected read fault\)"):
        jobs[1].handle.durable.result(60)
    assert any("step 2 could not be drained" in r.getMessage() and "injected read fault" in r.getMessage()
               for r in caplog.records)
    assert len(backend.fired) == 1 and backend.fired[0][0] == "read" and backend.fired[0][1].startswith(step2)
    backend.arm([])
    assert torch.equal(fp.open(root).load(2)["w"], torch.full((5000,), 2.0))  # the local commit
    assert [i.step for i in fp.open(durable).list() if i.committed] == [1, 3]
    assert torch.equal(fp.open(durable).load(3)["w"], torch.full((5000,), 3.0))


# ---------------------------------------------------------------------------------------------
# the durable tier in a directory: its own files


def test_the_directory_durable_tier_writes_through_its_backend(tmp_path: Any) -> None:
    """Regression: DirStore did os.open/os.write/os.fsync/os.link itself. Now its file
    operations go through the backend it is given: a refused link (the create-if-absent of a
    durable manifest) is a StoreError naming the file and the cause, nothing is left behind,
    and the object can be created once the fault is gone."""
    d = str(tmp_path / "durable")
    backend = FaultyBackend([Fault("link", errno.EIO, path_contains="manifest.json")])
    store = DirStore(d, backend)
    store.put("step-00000001/a.bin", b"abc")
    with pytest.raises(StoreError, match=r"cannot write .*step-00000001/manifest.json: Input/output error "
                                         r"\(injected link fault\)"):
        store.put_new("step-00000001/manifest.json", b"{}")
    assert store.list() == {"step-00000001/a.bin": 3}
    assert sorted(os.listdir(os.path.join(d, "step-00000001"))) == ["a.bin"]  # no temporary file left
    backend.arm([Fault("read", errno.EIO, path_contains="a.bin", at=2)])  # 1: the open, 2: the first read
    with pytest.raises(OSError, match="injected read fault"):
        list(store.chunks("step-00000001/a.bin", 3))
    backend.arm([])
    assert store.put_new("step-00000001/manifest.json", b"{}") is True
    assert store.get("step-00000001/manifest.json", 10) == b"{}"


# ---------------------------------------------------------------------------------------------
# publish: the folder fsync of a directory save


@pytest.mark.parametrize("exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_failed_folder_fsync_of_a_publish_fails_the_save_and_loses_nothing(tmp_path: Any, monkeypatch: Any,
                                                                             exchange: bool) -> None:
    """Regression: publishing a directory save fsync'd the directory's folder with the I/O
    engine's fsync_dir, out of reach of the fault backend. The fault here hits that fsync,
    which comes AFTER the exchange (or, without RENAME_EXCHANGE, after the two renames): ``X``
    already holds the new checkpoint. The save fails with an error naming the folder and the
    cause and saying that the name may not be durable; the checkpoint it replaced is kept (in
    ``X.fp-partial``, or ``X.fp-old`` without exchange), not removed, since a power loss could
    bring the previous names back; the next save publishes and cleans up."""
    if not exchange:
        monkeypatch.setenv("FASTPERSIST_NO_RENAME_EXCHANGE", "1")
    stage, target = str(tmp_path / "stage"), str(tmp_path / "pub" / "last.ckpt")
    folder = os.path.dirname(target)
    os.makedirs(folder)
    backend = FaultyBackend()
    ck = fp.Checkpointer(stage, comm="local", backend=backend)
    ck.save(1, {"w": torch.full((20_000,), 1.0), "i": 1}, directory=target).wait()
    backend.arm([Fault("fsync", errno.EIO, path=folder)])
    with pytest.raises(CheckpointWriteError) as info:
        ck.save(2, {"w": torch.full((20_000,), 2.0), "i": 2}, directory=target).wait()
    message = str(info.value)
    assert f"published as {target}" in message and f"its folder {folder} could not be fsync'd" in message
    assert "Input/output error (injected fsync fault)" in message
    assert backend.fired == [("fsync", folder)]
    kept = target + (PARTIAL_SUFFIX if exchange else OLD_SUFFIX)
    assert f"kept in {kept}" in message
    assert fp.open(target).load()["i"] == 2  # the new checkpoint, under the name
    assert fp.open(kept).load()["i"] == 1  # the previous one, kept whole
    backend.arm([])
    ck.save(3, {"w": torch.full((20_000,), 3.0), "i": 3}, directory=target).wait()
    ck.close()
    assert fp.open(target).load()["i"] == 3
    assert sorted(os.listdir(folder)) == ["last.ckpt"]
