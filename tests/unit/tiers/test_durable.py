"""The durable tier: committed checkpoints drained behind the local roots, and read back.

Most cases use a durable *directory* (a shared filesystem's role, real files); the cases that
need object storage run against real S3-compatible servers started by the suite
(tests/test_durable_s3.py).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading

import pytest
import torch

import fastpersist as fp
from fastpersist.tiers.durable.store import DirStore, StoreAccessError, StoreError
from fastpersist.errors import ChecksumMismatchError, CheckpointNotFoundError, CorruptCheckpointError
from helpers import SUPPORT, HeldStore, assert_state_equal, fsdp_mlp, gathered, per_rank, replicated, run_ranks

SMALL = 300_000


class FailingStore(DirStore):
    """A real durable directory whose first ``failures`` uploads of checkpoint files fail (EIO,
    or with ``error``)."""

    def __init__(self, path: str, failures: int, error: type[StoreError] = StoreError) -> None:
        super().__init__(path)
        self.failures = failures
        self.error = error
        self.calls = 0

    def put_file(self, key, chunks, size):  # type: ignore[no-untyped-def]
        if "/_drain/" not in key:
            self.calls += 1
        if "/_drain/" not in key and self.calls <= self.failures:
            raise self.error(f"cannot write {self.where(key)}: {os.strerror(errno.EIO)} (injected)")
        super().put_file(key, chunks, size)


def durable_steps(path: str) -> list[int]:
    return [i.step for i in fp.open(path).list() if i.committed]


# ---------------------------------------------------------------------------------------------
# drained, then read with no local root left


def test_drained_checkpoint_loads_without_the_local_roots(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    durable = str(tmp_path / "durable")
    ck = fp.Checkpointer(roots, mode="snapshot", durable=durable)
    handles = [ck.save(s, replicated(s, SMALL), rank_state=per_rank(s, 0), metadata={"s": s}) for s in (1, 2)]
    ck.close()
    assert [h.durable.result(0) for h in handles] == [True, True]
    for r in roots:
        shutil.rmtree(r)
    view = fp.open(durable)  # a durable directory is a checkpoint root like any other
    assert durable_steps(durable) == [1, 2] and view.latest_step() == 2
    assert_state_equal(view.load(1), replicated(1, SMALL))
    assert_state_equal(view.load_rank_state(2, rank=0), per_rank(2, 0))
    assert view.metadata(2) == {"s": 2} and view.verify(2) == []
    m = view.manifest(2)
    assert m.roots == 1 and {f.root for f in m.files} == {0}
    assert any(f.name.startswith("root1-") for f in m.files)  # the second root's files, renamed into one directory

    # a Checkpointer on new, empty roots falls back to the durable tier, then goes on
    ck = fp.Checkpointer(roots, mode="sync", durable=durable)
    assert_state_equal(ck.load(), replicated(2, SMALL))
    assert_state_equal(ck.load(1), replicated(1, SMALL))
    with pytest.raises(CheckpointNotFoundError):
        ck.load(7)
    ck.save(3, replicated(3, SMALL))
    ck.close()
    # commit order continues across the tiers: the new machine's first commit comes after
    # everything drained before it
    assert fp.open(roots).manifest(3).sequence > view.manifest(2).sequence
    assert fp.open(durable).latest_step() == 3


def test_latest_is_the_most_recent_commit_of_either_tier(tmp_path):
    roots, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    ck = fp.Checkpointer(roots, mode="sync", durable=durable, durable_every=10)
    assert ck.save(1, replicated(1, SMALL)).durable.result(30) is True
    assert ck.save(2, replicated(2, SMALL)).durable.result(0) is False  # not due: local only
    assert durable_steps(durable) == [1]
    assert_state_equal(ck.load(), replicated(2, SMALL))
    ck.close()


def _ranks_save_sharded(rank: int, world: int, roots: list[str], durable: str) -> dict:
    torch.manual_seed(0)
    model, opt = fsdp_mlp(world)
    model(torch.randn(4, 48)).sum().backward()
    opt.step()
    ck = fp.Checkpointer(roots, mode="snapshot", durable=durable)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 5}
    h = ck.save(5, state, rank_state={"rank": rank})
    ck.close()
    return {"drained": h.durable.result(0), "state": gathered(state)}


def test_ranks_drain_their_own_files_and_it_loads_at_another_world_size(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    durable = str(tmp_path / "durable")
    results = run_ranks(tmp_path, 2, _ranks_save_sharded, roots, durable)
    assert [r["drained"] for r in results] == [True, True]
    for r in roots:
        shutil.rmtree(r)
    m = fp.open(durable).manifest(5)
    assert m.world_size == 2 and m.sharded  # DTensor chunks written by their owners, drained by them
    loaded = gathered(fp.open(durable).load(5))  # world size 1: whole tensors, resharded
    assert loaded.keys() == results[0]["state"].keys()
    for k, v in results[0]["state"].items():
        assert_state_equal(loaded[k], v)
    assert fp.open(durable).load_rank_state(5, rank=1) == {"rank": 1}
    assert not [k for k in DirStore(durable).list() if "_drain" in k]  # the ranks' markers are gone


def _ranks_one_fails(rank: int, world: int, root: str, durable: str) -> str:
    store = FailingStore(durable, failures=10**9, error=StoreAccessError) if rank == 1 else DirStore(durable)
    ck = fp.Checkpointer(root, mode="sync", durable=store, timeout_s=120)
    h = ck.save(1, replicated(1, SMALL))
    ck.close()
    error = h.durable.exception(0)
    return f"{type(error).__name__}: {error}"


def test_a_rank_whose_part_fails_fails_the_durable_commit_at_once(tmp_path):
    durable = str(tmp_path / "durable")
    results = run_ranks(tmp_path, 2, _ranks_one_fails, str(tmp_path / "ck"), durable)
    assert "rank 1 could not upload its part" in results[0] and "injected" in results[0]
    assert "StoreAccessError" in results[1]
    assert durable_steps(durable) == []


# ---------------------------------------------------------------------------------------------
# the drain's checks and failures never touch training


def test_damaged_local_copy_is_never_uploaded(tmp_path):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    store = HeldStore(durable, hold="replicated-0000")
    ck = fp.Checkpointer(root, mode="sync", durable=store)
    h = ck.save(1, replicated(1, SMALL))
    assert store.holding.wait(30)  # the skeleton is up; the data file's upload waits
    data = next(os.path.join(root, "step-00000001", f) for f in os.listdir(os.path.join(root, "step-00000001"))
                if f.endswith("replicated-0000.bin"))
    with open(data, "r+b") as f:  # the local disk damages a byte before the drain reads it
        f.seek(4096 + 100)
        b = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    store.released.set()
    with pytest.raises(ChecksumMismatchError, match="replicated-0000.bin"):
        h.durable.result(30)
    assert durable_steps(durable) == []  # nothing damaged was committed there
    ck.close()  # a failed drain is not a failed save


def test_failed_upload_is_retried(tmp_path, caplog):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    store = FailingStore(durable, failures=2)  # two attempts fail, the third goes through
    ck = fp.Checkpointer(root, mode="sync", durable=store)
    with caplog.at_level(logging.INFO, logger="fastpersist"):
        h = ck.save(1, replicated(1, SMALL))
        assert h.durable.result(60) is True
    assert len([r for r in caplog.records if "again in" in r.getMessage()]) == 2
    assert_state_equal(fp.open(durable).load(1), replicated(1, SMALL))
    ck.close()


def test_a_drain_that_keeps_failing_never_fails_training(tmp_path, caplog):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    store = FailingStore(durable, failures=10**9, error=StoreAccessError)  # not retried
    ck = fp.Checkpointer(root, mode="snapshot", durable=store, keep=1)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        handles = [ck.save(s, replicated(s, SMALL)) for s in (1, 2)]
        ck.close()  # finishes the drains; their failures are logged, not raised
    for h in handles:
        assert h.result() is not None
        with pytest.raises(StoreError, match="injected"):
            h.durable.result(0)
    assert any("could not be drained" in r.getMessage() for r in caplog.records)
    assert_state_equal(fp.open(root).load(), replicated(2, SMALL))
    assert durable_steps(durable) == []


def test_local_copy_is_kept_until_its_drain_ends(tmp_path):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    store = HeldStore(durable, hold="step-00000001/")
    ck = fp.Checkpointer(root, mode="sync", durable=store, keep=1)
    h1 = ck.save(1, replicated(1, SMALL))
    assert store.holding.wait(30)
    later = [ck.save(s, replicated(s, SMALL)) for s in (2, 3)]
    # keep=1, but step 1 is still being drained and step 2 waits for its turn: both stay
    assert [i.step for i in ck.list()] == [1, 2, 3]
    store.released.set()
    assert [h.durable.result(60) for h in [h1, *later]] == [True, True, False]  # 3: the queue was full
    ck.save(4, replicated(4, SMALL))  # retention applies to them again
    ck.wait()
    assert [i.step for i in ck.list()] == [4]
    ck.close()
    assert durable_steps(durable) == [1, 2, 4]


def _nice_of_thread(prefix: str) -> int:
    thread = next((t for t in threading.enumerate() if t.name.startswith(prefix)), None)
    if thread is None:
        raise AssertionError(f"no thread named {prefix}*")
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[16])  # field 19 of stat: nice


@pytest.mark.parametrize("nice", [10, 17])
def test_the_drain_runs_at_a_lower_cpu_priority(tmp_path, nice):
    store = HeldStore(str(tmp_path / "durable"), hold="step-00000001/")
    with fp.configure(drain_nice=nice):
        ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", durable=store)
    h = ck.save(1, replicated(1, SMALL))
    assert store.holding.wait(30)
    try:
        assert _nice_of_thread("fastpersist-drain") == nice
        assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # training's threads are untouched
    finally:
        store.released.set()
    assert h.durable.result(60) is True
    ck.close()


def test_drains_slower_than_saves_never_pile_up(tmp_path, caplog):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    store = HeldStore(durable, hold="step-00000001/")
    ck = fp.Checkpointer(root, mode="sync", durable=store, keep=1)
    with caplog.at_level(logging.INFO, logger="fastpersist"):
        handles = {1: ck.save(1, replicated(1, SMALL))}
        assert store.holding.wait(30)
        handles.update({s: ck.save(s, replicated(s, SMALL)) for s in (2, 3, 4)})
    # one drain runs (1), one waits (2); 3 and 4 are not drained, and their local copies are
    # not held back by retention
    assert [handles[s].durable.result(0) for s in (3, 4)] == [False, False]
    assert any("step 3 is not drained" in r.getMessage() for r in caplog.records)
    assert [i.step for i in ck.list()] == [1, 2, 4]
    store.released.set()
    assert [handles[s].durable.result(60) for s in (1, 2)] == [True, True]
    assert ck.save(5, replicated(5, SMALL)).durable.result(60) is True  # room again: the next due step goes
    ck.close()
    assert durable_steps(durable) == [1, 2, 5]


def test_durable_every_and_durable_keep(tmp_path):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    ck = fp.Checkpointer(root, mode="sync", durable=durable, durable_every=3, durable_keep=2)
    handles = {}
    for s in range(1, 9):
        handles[s] = ck.save(s, replicated(s, SMALL))
        handles[s].durable.result(60)  # each drain ends before the next save: none is skipped for room
    ck.close()
    drained = {s for s, h in handles.items() if h.durable.result(0)}
    assert drained == {1, 4, 7}
    assert durable_steps(durable) == [4, 7]  # durable_keep=2
    # a new timeline (a resume from step 2): drained at once, and the latest durable step is
    # never deleted by the durable tier's retention
    ck = fp.Checkpointer(root, mode="sync", durable=durable, durable_keep=1)
    ck.save(3, replicated(30, SMALL))
    ck.close()
    assert fp.open(durable).latest_step() == 3
    assert_state_equal(fp.open(durable).load(), replicated(30, SMALL))
    assert 3 in durable_steps(durable)


def test_damaged_durable_checkpoint_falls_back_to_an_older_one(tmp_path, caplog):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    ck = fp.Checkpointer(root, mode="sync", durable=durable)
    for s in (1, 2):
        ck.save(s, replicated(s, SMALL))
    ck.close()
    m = fp.open(durable).manifest(2)
    extent = m.objects["replicated"].storages[0].extents[0]
    data = m.files[extent.file].name
    with open(os.path.join(durable, "step-00000002", data), "r+b") as f:
        f.seek(extent.offset + 7)
        b = f.read(1)
        f.seek(extent.offset + 7)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ChecksumMismatchError, match=data):
        fp.open(durable).load(2)
    assert fp.open(durable).verify(2)
    shutil.rmtree(root)
    ck = fp.Checkpointer(root, mode="sync", durable=durable)
    with pytest.raises(CorruptCheckpointError, match=data):  # asked for by number: that step or an error
        ck.load(2)
    ck.close()


def test_arguments_are_checked(tmp_path):
    root = str(tmp_path / "ck")
    with pytest.raises(ValueError, match="durable_every"):
        fp.Checkpointer(root, durable=str(tmp_path / "d"), durable_every=0)
    with pytest.raises(TypeError, match="durable_keep"):
        fp.Checkpointer(root, durable=str(tmp_path / "d"), durable_keep=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="durable_bandwidth"):
        fp.Checkpointer(root, durable=str(tmp_path / "d"), durable_bandwidth=0)
    with pytest.raises(ValueError, match="one of the local roots"):
        fp.Checkpointer(root, durable=root)
    with pytest.raises(ValueError, match="only directories and s3://"):
        fp.Checkpointer(root, durable="gs://bucket/x")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file"):
        fp.Checkpointer(root, durable=str(tmp_path / "file"))



_EXIT_CHILD = """
import sys
sys.path.insert(0, {tests!r})
import fastpersist as fp
from helpers import replicated
from helpers import HeldStore
store = HeldStore({durable!r}, hold="step-00000002/")
ck = fp.Checkpointer({root!r}, mode="snapshot", durable=store)
ck.save(1, replicated(1, {small}))
ck.save(2, replicated(2, {small}))
store.holding.wait(60)
store.released.set()
# returns from main with step 2's drain in flight and no close()
"""


def test_drain_in_flight_at_exit_is_finished(tmp_path):
    import subprocess
    import sys

    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    code = _EXIT_CHILD.format(tests=SUPPORT, root=root, durable=durable, small=SMALL)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert durable_steps(durable) == [1, 2]
    assert_state_equal(fp.open(durable).load(2), replicated(2, SMALL))


def test_a_fetch_left_in_a_root_by_a_crash_is_removed_at_the_clean_start(tmp_path):
    root = tmp_path / "ck"
    left = root / ".fastpersist-tmp-fetch-abc123" / "step-00000004"
    left.mkdir(parents=True)
    (left / "data.bin").write_bytes(b"x" * 100)
    ck = fp.Checkpointer(str(root), mode="sync")
    ck.save(1, replicated(1, SMALL))
    ck.close()
    assert sorted(os.listdir(root)) == [".fastpersist.lock", "latest", "step-00000001"]


def test_resume_on_new_machines_follows_the_durable_tier(tmp_path):
    """The README's resume loop, on empty roots: it resumes from the durable tier and the
    timeline goes on (nothing drained before is abandoned)."""
    roots, durable = [str(tmp_path / "a"), str(tmp_path / "b")], str(tmp_path / "durable")
    ck = fp.Checkpointer(roots, mode="sync", durable=durable)
    for s in (1, 2, 3):
        ck.save(s, {"step": s, "w": replicated(s, SMALL)}).durable.result(60)
    ck.close()
    for r in roots:
        shutil.rmtree(r)
    ck = fp.Checkpointer(roots, mode="sync", durable=durable)
    start = 0
    if ck.latest_step() is not None:
        start = ck.load("latest")["step"] + 1
    assert start == 4
    assert ck.metadata("latest") == {} and ck.latest_step() == 3
    ck.save(start, {"step": start, "w": replicated(start, SMALL)}).durable.result(60)
    ck.close()
    infos = fp.open(durable).list()
    assert [(i.step, i.abandoned) for i in infos] == [(1, False), (2, False), (3, False), (4, False)]
    assert fp.open(durable).latest_step() == 4


def test_a_damaged_local_copy_is_read_from_the_durable_tier(tmp_path, caplog):
    root, durable = str(tmp_path / "ck"), str(tmp_path / "durable")
    ck = fp.Checkpointer(root, mode="sync", durable=durable)
    ck.save(1, replicated(1, SMALL)).durable.result(60)
    m = fp.open(root).manifest(1)
    extent = m.objects["replicated"].storages[0].extents[0]
    with open(os.path.join(root, "step-00000001", m.files[extent.file].name), "r+b") as f:
        f.seek(extent.offset + 5)
        b = f.read(1)
        f.seek(extent.offset + 5)
        f.write(bytes([b[0] ^ 4]))
    with pytest.raises(ChecksumMismatchError):
        fp.open(root).load(1)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert_state_equal(ck.load(1), replicated(1, SMALL))
        assert_state_equal(ck.load(), replicated(1, SMALL))
    assert any("cannot be read from the local roots" in r.getMessage() for r in caplog.records)
    ck.close()


def _ranks_differ(rank: int, world: int, root: str, durable: str) -> str:
    try:
        fp.Checkpointer(root, durable=durable if rank == 0 else None)
    except ValueError as e:
        return str(e)
    return "constructed"


def test_ranks_given_different_durable_locations_all_refuse(tmp_path):
    results = run_ranks(tmp_path, 2, _ranks_differ, str(tmp_path / "ck"), str(tmp_path / "durable"))
    assert all("different durable locations" in r for r in results), results
