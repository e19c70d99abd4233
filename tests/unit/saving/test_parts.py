"""The parts of the save core alone, each without a Checkpointer: the driver (one queue, one
worker, back-pressure, failures), the stager (what save() copies into the arena), the rank
writer (one rank's files, the extensions' work beside them), the coordinator (commit, an earlier
save of the same step, retention) and the janitor (deletions in the background)."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch
from cores import job, make_protocol

import fastpersist as fp
from fastpersist.dist import LocalComm
from fastpersist.errors import CheckpointError, CheckpointWriteError
from fastpersist.options import Retention
from fastpersist.saving.driver import SaveDriver
from fastpersist.saving.extension import Extension, Written, run_beside
from fastpersist.saving.handle import Completion, SaveHandle, SaveMetrics
from fastpersist.saving.job import SaveJob
from fastpersist.saving.retention import Janitor
from fastpersist.saving.stage import Stager
from fastpersist.storage import catalog
from fastpersist.storage.faults import Fault, FaultyBackend
from fastpersist.timeline import Commit

# ---------------------------------------------------------------------------------------------
# the driver


def _completion(step: int) -> Completion:
    return Completion(SaveHandle(SaveMetrics(step, "snapshot")))


def test_the_driver_runs_jobs_in_submission_order_on_one_thread():
    ran: list[tuple[int, str]] = []
    driver = SaveDriver(lambda j: ran.append((j.step, threading.current_thread().name)), lambda j, e: None,
                        LocalComm(), max_in_flight=8)
    jobs = [job(s, {}) for s in range(5)]
    for j in jobs:
        assert driver.make_room(j.completion)
        driver.submit(j)
    driver.wait(60)
    assert [s for s, _ in ran] == [0, 1, 2, 3, 4]
    assert {name for _, name in ran} == {"fastpersist-save"}
    assert [j.number for j in jobs] == [1, 2, 3, 4, 5]
    driver.stop()


def test_the_driver_skips_when_busy_and_raises_a_failure_once():
    release = threading.Event()

    def run(j: SaveJob) -> None:
        release.wait(60)
        if j.step == 1:
            raise CheckpointWriteError("step 1 failed")

    driver = SaveDriver(run, lambda j, e: None, LocalComm(), max_in_flight=1, when_busy="skip")
    first = job(1, {})
    assert driver.make_room(first.completion)
    driver.submit(first)
    second = job(2, {})
    assert not driver.make_room(second.completion)  # one in flight: skipped, not queued
    assert second.metrics.skipped and second.handle.done()
    assert driver.steps() == {1}
    with pytest.raises(TimeoutError, match="step 1 is still in flight"):
        driver.wait(0.05)
    release.set()
    driver.wait(60)
    with pytest.raises(CheckpointWriteError, match="step 1 failed"):
        driver.raise_failed()
    driver.raise_failed()  # raised once: nothing the second time
    driver.stop()


# ---------------------------------------------------------------------------------------------
# the stager


def test_the_stager_copies_the_state_into_the_arena_so_training_can_go_on():
    w = torch.arange(100_000, dtype=torch.float32)
    stager = Stager(1 << 30, 0)
    j = job(1, {"w": w, "n": 3})
    assert stager.stage(j, set())
    arena = stager.arena
    staged = j.state["w"]
    assert staged.data_ptr() != w.data_ptr() and torch.equal(staged, w)
    w += 1  # training goes on: the staged copy keeps the state at save time
    assert torch.equal(staged, torch.arange(100_000, dtype=torch.float32))
    assert arena.busy and j.metrics.bytes_copied == w.nbytes
    stager.release(j)
    assert not arena.busy


def test_the_stager_leaves_live_storages_and_refuses_over_its_budget():
    w, b = torch.ones(1000), torch.zeros(1000)
    stager = Stager(8192, 0)
    j = job(1, {"w": w, "b": b})
    assert stager.stage(j, {w.untyped_storage().data_ptr()})  # b copied, w written from live memory
    assert j.state["w"].data_ptr() == w.data_ptr() and j.state["b"].data_ptr() != b.data_ptr() and j.live
    stager.release(j)
    assert not stager.stage(job(2, {"big": torch.ones(10_000)}), set())  # 40 kB over an 8 KiB budget


# ---------------------------------------------------------------------------------------------
# the rank writer (through the protocol of one rank)


class BesideFails(Extension):
    name = "beside-fails"

    def beside_write(self, job, plan, writer):  # type: ignore[no-untyped-def]
        def fail() -> Written:
            raise OSError(errno.EIO, "the copy beside failed")

        return run_beside(self.name, fail)


def test_work_beside_the_writes_that_fails_fails_the_save_after_the_writes_end(tmp_path):
    root = str(tmp_path / "r")
    p = make_protocol(LocalComm(), [root], [BesideFails()])
    j = job(1, {"w": torch.ones(1000)})
    with pytest.raises(CheckpointError, match="the copy beside failed"):
        p.run(j)
    assert j.handle.staged.done()  # training may go on: nothing reads its tensors any more
    step_dir = os.path.join(root, "step-00000001")
    assert not os.path.exists(step_dir) or os.listdir(step_dir) == []  # its files removed


def test_the_writer_fsyncs_the_directories_before_reporting(tmp_path):
    """The data files' directory entries are durable before the rank says its data is written
    (the "after-data" point, before the commit's own fsync of the directory)."""
    root = str(tmp_path / "r")
    backend = FaultyBackend([Fault("fsync", path_contains="step-00000001", at=0, errno=None),
                             Fault("event", point="after-data", at=0, errno=None)])
    p = make_protocol(LocalComm(), [root], backend=backend)
    p.run(job(1, {"w": torch.ones(1000)}))
    step_dir = os.path.join(root, "step-00000001")
    data_written = backend.fired.index(("event", "after-data"))
    assert ("fsync", step_dir) in backend.fired[:data_written]  # the directory, not only its files


# ---------------------------------------------------------------------------------------------
# the coordinator and the janitor


def test_the_coordinator_replaces_an_earlier_save_of_the_same_step_and_applies_retention(tmp_path):
    root = str(tmp_path / "r")
    p = make_protocol(LocalComm(), [root], keep=2)
    p.run(job(1, {"w": torch.ones(10)}, number=1))
    first = set(os.listdir(os.path.join(root, "step-00000001")))
    p.run(job(1, {"w": torch.full((10,), 2.0)}, number=2))  # step 1 again: its earlier files go
    second = set(os.listdir(os.path.join(root, "step-00000001")))
    assert not (first - {"manifest.json"}) & second
    for s in (2, 3):
        p.run(job(s, {"w": torch.ones(10)}, number=s + 1))
    p.coordinator.janitor.drain()
    assert [i.step for i in fp.open(root).list()] == [2, 3]
    assert torch.equal(fp.open(root).load(3)["w"], torch.ones(10))
    assert p.coordinator.is_committed(3, fp.open(root).manifest(3).save_id)
    p.close()


def test_the_janitor_keeps_a_checkpoint_whose_manifest_cannot_be_removed(tmp_path):
    root = str(tmp_path / "r")
    p = make_protocol(LocalComm(), [root])
    for s in (1, 2):
        p.run(job(s, {"w": torch.ones(10)}, number=s))
    backend = FaultyBackend([Fault("delete", path_contains="step-00000001", errno=errno.EACCES)])
    janitor = Janitor([root], backend)
    kept: list[int] = []
    commit = Commit(1, 1, time.time())
    janitor.delete({1: commit, 2: Commit(2, 2, time.time())}, lambda step, c: kept.append(step))
    janitor.drain()
    assert kept == [1]  # still committed, and the coordinator hears of it
    assert [e.step for e in catalog.scan(root) if e.committed] == [1]
    janitor.close()
    assert Retention(keep=1).to_delete([commit, Commit(2, 2, 0.0)]) == [1]


# ---------------------------------------------------------------------------------------------
# the saver (the training thread's side)


def _saver(mode: str, run, **kw):  # type: ignore[no-untyped-def]
    from fastpersist.saving.saver import Saver

    args = dict(mode=mode, max_in_flight=1, when_busy="wait", snapshot_bytes=1 << 30, history=10,
                config=fp.get_config, roots=1)
    args.update(kw)
    return Saver(run, LocalComm(), **args)  # type: ignore[arg-type]


def test_the_saver_returns_once_staged_and_the_job_runs_on_a_copy():
    release, seen = threading.Event(), []

    def run(j: SaveJob) -> None:
        release.wait(60)
        seen.append(j.state["w"].clone())

    saver = _saver("snapshot", run)
    w = torch.zeros(1000)
    handle = saver.save(1, {"w": w}, None, None, None, time.perf_counter())
    assert handle.staged.done() and not handle.done()  # save() returned before the write
    w += 1  # training goes on
    release.set()
    handle.result(60)
    assert torch.equal(seen[0], torch.zeros(1000)) and list(saver.history)[-1].step == 1
    saver.close()


def test_a_sync_saver_waits_for_the_commit_and_raises_its_failure():
    def run(j: SaveJob) -> None:
        if j.step == 2:
            raise CheckpointWriteError("step 2 failed")

    saver = _saver("sync", run)
    assert saver.save(1, {"w": torch.ones(3)}, None, None, None, time.perf_counter()).done()
    with pytest.raises(CheckpointWriteError, match="step 2 failed"):
        saver.save(2, {"w": torch.ones(3)}, None, None, None, time.perf_counter())
    assert saver.reserve({"w": torch.ones(3)}, None, None).result(60) == 0  # sync saves copy nothing
    saver.close()
