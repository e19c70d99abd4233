"""The fault matrix: injected and real faults in every mode, in one process and over gloo ranks.

Every case checks the same four things: the caller gets a clear error (naming the cause, and
the rank when several), nothing committed is lost, nothing partial stays behind, and the next
save succeeds once the fault is gone (training can go on)."""

from __future__ import annotations

import errno
import json
import os

import pytest
from helpers import states_equal as _equal
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer
from fastpersist.storage.faults import Fault, FaultyBackend
from conftest import remount

MODES = ["sync", "snapshot", "overlap"]

CASES = {
    "ENOSPC during data": ([Fault("write", errno.ENOSPC, at=2)], "No space left"),
    "ENOSPC during commit": ([Fault("write", errno.ENOSPC, path_contains="manifest.json")], "No space left"),
    "EIO from write": ([Fault("write", errno.EIO, at=3)], "Input/output error"),
    "EIO from fsync": ([Fault("fsync", errno.EIO, at=1)], "Input/output error"),
    "permission denied": ([Fault("open", errno.EACCES, at=1)], "Permission denied"),
    "rename refused": ([Fault("rename", errno.EIO, path_contains="manifest.json")], "Input/output error"),
}


def state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(100_000, generator=g), "b": [torch.randn(7, generator=g) for _ in range(10)], "step": step}


def _only_committed_left(roots: list[str]) -> None:
    for root in roots:
        for name in os.listdir(root):
            if name.startswith("step-"):
                assert os.path.exists(os.path.join(roots[0], name, "manifest.json")), f"partial {name} left in {root}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_injected_fault(tmp_path, small_io, mode, case):
    faults, message = CASES[case]
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    backend = FaultyBackend()
    ck = Checkpointer(roots, mode=mode, backend=backend, config=small_io)
    ck.save(1, state(1)).wait()
    backend.arm(faults)
    with pytest.raises(fp.CheckpointWriteError, match=message):
        ck.save(2, state(2)).wait()
    assert backend.fired
    assert ck.latest_step() == 1 and _equal(ck.load(), state(1))
    assert [i.step for i in ck.list()] == [1]
    _only_committed_left(roots)
    backend.arm([])  # the fault is gone: training goes on
    ck.save(3, state(3)).wait()
    ck.close()
    assert ck.latest_step() == 3 and _equal(ck.load(3), state(3))


@pytest.mark.parametrize("mode", MODES)
def test_real_full_disk(small_fs, mode):
    ck = Checkpointer([small_fs], mode=mode)
    ck.save(1, {"x": torch.ones(256 * 1024)}).wait()
    with pytest.raises(fp.CheckpointWriteError, match="No space left"):
        ck.save(2, {"x": torch.ones(4 * 1024 * 1024)}).wait()  # 16 MiB into 8 MiB
    assert ck.latest_step() == 1 and torch.equal(ck.load()["x"], torch.ones(256 * 1024))
    _only_committed_left([small_fs])
    ck.save(3, {"x": torch.full((1000,), 3.0)}).wait()  # fits: goes on
    ck.close()


@pytest.mark.parametrize("mode", MODES)
def test_root_turns_read_only(remountable_fs, mode):
    with Checkpointer([remountable_fs], mode=mode) as ck:
        ck.save(1, state(1)).wait()
    ck = Checkpointer([remountable_fs], mode=mode)  # the root turns read-only under a running job
    remount(remountable_fs, "ro")  # (a file open for writing, like the root's lock, would refuse it)
    try:
        with pytest.raises(fp.CheckpointWriteError, match="Read-only file system"):
            ck.save(2, state(2)).wait()
        assert ck.latest_step() == 1 and _equal(ck.load(), state(1))
    finally:
        remount(remountable_fs, "rw")
    ck.save(3, state(3)).wait()
    ck.close()
    assert _equal(ck.load(), state(3))


@pytest.mark.parametrize("mode", MODES)
def test_slow_root_is_only_slow(tmp_path, small_io, mode):
    roots = [str(tmp_path / "fast"), str(tmp_path / "slow")]
    backend = FaultyBackend([Fault("write", None, at=0, root=1, delay_s=0.01)])
    ck = Checkpointer(roots, mode=mode, backend=backend, config=small_io)
    metrics = ck.save(1, state(1)).wait()
    ck.close()
    assert backend.fired and metrics.write_s >= 0.01  # requests to the slow root run two at a time
    assert set(metrics.bytes_per_root) == {0, 1} and _equal(ck.load(1), state(1))


def test_second_job_on_the_same_root_is_refused(tmp_path):
    root = str(tmp_path / "shared")
    first = Checkpointer(root)
    first.save(1, state(1)).wait()
    second = Checkpointer(root)
    with pytest.raises(fp.CheckpointWriteError, match=r"in use by another Checkpointer \(pid \d+"):
        second.save(2, state(2)).wait()
    assert [i.step for i in first.list()] == [1] and _equal(first.load(), state(1))
    first.save(3, state(3)).wait()  # the first job is unharmed
    first.close()
    second.save(4, state(4)).wait()  # once released, the root can be taken
    second.close()


def test_stale_lock_of_a_dead_job_is_taken_over(tmp_path, caplog):
    import subprocess
    import sys

    root = str(tmp_path / "root")
    code = ("import os, signal, torch; from fastpersist.checkpointer import Checkpointer; "
            f"c = Checkpointer({root!r}); c.save(1, {{'x': torch.ones(3)}}).wait(); "
            "os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert json.load(open(os.path.join(root, ".fastpersist.lock")))["pid"] > 0  # left behind
    with caplog.at_level("INFO", logger="fastpersist.storage.lock"), Checkpointer(root) as ck:
        ck.save(2, state(2)).wait()
    assert "no longer running" in caplog.text
    assert [i.step for i in ck.list()] == [1, 2]


# ---------------------------------------------------------------------------------------------
# over gloo ranks


def _rank_worker(rank: int, world: int, init: str, root: str, mode: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    try:
        backend = FaultyBackend()
        ck = Checkpointer([root], mode=mode, backend=backend, timeout_s=30)
        ck.save(1, state(1)).wait()
        for name, faults in [
            ("ENOSPC on rank 1", [Fault("write", errno.ENOSPC, at=1, rank=1)]),
            ("EIO fsync on rank 2", [Fault("fsync", errno.EIO, at=1, rank=2)]),
            ("ENOSPC in commit", [Fault("write", errno.ENOSPC, rank=0, path_contains="manifest.json")]),
        ]:
            backend.arm(faults)
            try:
                ck.save(2, state(2)).wait()
                results[name] = "no error"
            except fp.CheckpointWriteError as e:
                results[name] = str(e).splitlines()[0]
            backend.arm([])
        ck.save(3, state(3)).wait()
        results["after"] = ck.latest_step()
        ck.close()
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", MODES)
def test_faults_over_three_ranks(tmp_path, mode):
    root = str(tmp_path / "root")
    mp.start_processes(_rank_worker, args=(3, f"file://{tmp_path}/rdv", root, mode, str(tmp_path)), nprocs=3,
                       start_method="spawn")
    results = [json.load(open(tmp_path / f"rank{r}.json")) for r in range(3)]
    for res in results:
        assert "failed on rank 1: " in res["ENOSPC on rank 1"] and "No space left" in res["ENOSPC on rank 1"], res
        assert "failed on rank 2: " in res["EIO fsync on rank 2"], res
        assert "committing checkpoint step 2 failed on rank 0" in res["ENOSPC in commit"], res
        assert res["after"] == 3
    ck = Checkpointer([root])
    assert [i.step for i in ck.list()] == [1, 3] and _equal(ck.load(3), state(3))


def _dying_worker(rank: int, world: int, init: str, root: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    backend = FaultyBackend([Fault("write", None, at=1, rank=2, kill=True)])  # rank 2 dies mid-write
    ck = Checkpointer([root], backend=backend, timeout_s=20)
    try:
        ck.save(1, state(1)).wait()
        message = "no error"
    except fp.CheckpointError as e:
        message = str(e).splitlines()[0]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"message": message}, f)
    os._exit(0)  # the group is broken: skip the collective teardown


def test_a_rank_dies_mid_save(tmp_path):
    root = str(tmp_path / "root")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_dying_worker, args=(r, 3, f"file://{tmp_path}/rdv", root, str(tmp_path)))
             for r in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)  # a hang guard: the survivors raise (timeout_s=20), they do not hang
    hung = [p for p in procs if p.exitcode is None]
    for p in hung:
        p.kill()
        p.join()
    assert not hung and [p.exitcode for p in procs] == [0, 0, -9]
    for r in (0, 1):
        res = json.load(open(tmp_path / f"rank{r}.json"))
        assert "coordination failed" in res["message"] or "failed on rank" in res["message"], res
    assert not os.path.exists(os.path.join(root, "step-00000001", "manifest.json"))
