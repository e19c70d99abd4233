"""Saving a checkpoint into a directory the caller names (``save(..., directory=X)``), and
``comm="local"``: the two calls frameworks need (Lightning's plugins are built on them).

Real files, real SIGKILLs of a child process at each point of a publish, a real second
filesystem (tmpfs) for the cross-filesystem refusal, real gloo ranks for ``comm="local"``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

import fastpersist as fp
from fastpersist.errors import CheckpointNotFoundError, CheckpointWriteError
from fastpersist.storage.publish import OLD_SUFFIX, PARTIAL_SUFFIX, directory_checkpoint, sweep
from helpers import REPO, run_ranks

SRC = os.path.join(REPO, "src")


def _state(i: int) -> dict:
    return {"w": torch.full((50_000,), float(i)), "i": i}


def test_directory_save_replaces_the_directory_with_the_new_checkpoint(tmp_path) -> None:
    stage, target = str(tmp_path / "stage"), str(tmp_path / "last.ckpt")
    with fp.Checkpointer(stage, comm="local") as ck:
        for i in range(3):
            h = ck.save(i, _state(i), rank_state={"mine": i}, directory=target)
            h.wait()  # the handle completes once the directory holds the checkpoint
            view = fp.open(target)
            assert [c.step for c in view.list()] == [i]
            assert view.load()["i"] == i and torch.equal(view.load()["w"], _state(i)["w"])
            assert view.load_rank_state(rank=0)["mine"] == i
        # moved out of the staging root, nothing left behind beside the directory
        assert [c.step for c in fp.list_checkpoints(stage)] == []
        assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "stage"]
        # a plain save keeps working beside directory saves
        ck.save(7, _state(7)).wait()
        assert ck.latest_step() == 7
    assert fp.load_checkpoint(directory_checkpoint(target))["i"] == 2
    assert fp.open(target).verify() == []


def test_retention_does_not_count_directory_saves(tmp_path) -> None:
    """keep=2 keeps the last two checkpoints under the roots; one moved into a directory is
    not one of them (it would evict a plain checkpoint and leave one)."""
    with fp.Checkpointer(str(tmp_path / "root"), comm="local", keep=2) as ck:
        ck.save(1, _state(1)).wait()
        ck.save(2, _state(2)).wait()
        ck.save(3, _state(3), directory=str(tmp_path / "x")).wait()
        assert [c.step for c in ck.list() if c.committed] == [1, 2]
        ck.save(4, _state(4)).wait()
        assert [c.step for c in ck.list() if c.committed] == [2, 4]


def test_directory_save_is_refused_where_the_checkpoint_is_not_one_directory(tmp_path) -> None:
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with fp.Checkpointer(roots, comm="local") as ck:
        with pytest.raises(ValueError, match="several roots"):
            ck.save(1, _state(1), directory=str(tmp_path / "x"))
    with fp.Checkpointer(str(tmp_path / "c"), durable=str(tmp_path / "durable")) as ck:
        with pytest.raises(ValueError, match="durable tier"):
            ck.save(1, _state(1), directory=str(tmp_path / "x"))
        with pytest.raises(TypeError, match="must be a path"):
            ck.save(1, _state(1), directory=3)  # type: ignore[arg-type]
    assert not os.path.exists(tmp_path / "x")


def test_directory_on_another_filesystem_fails_naming_both_and_keeps_the_commit(tmp_path, small_fs) -> None:
    stage = str(tmp_path / "stage")
    target = os.path.join(small_fs, "last.ckpt")
    ck = fp.Checkpointer(stage, comm="local")
    with pytest.raises(CheckpointWriteError, match="could not be moved into.*roots' filesystem"):
        ck.save(1, _state(1), directory=target).wait()
    assert os.listdir(small_fs) == []
    # the checkpoint is committed under the roots all the same
    assert fp.open(stage).load(1)["i"] == 1
    ck.close()  # the failure was raised once, by the handle


_CHILD = r"""
import sys, torch, fastpersist as fp
from fastpersist.storage.faults import Fault, FaultyBackend
stage, target, where = sys.argv[1:4]
# the renames of a publish whose paths hold the target's name: the step directory into the
# partial, its `latest`, then (without exchange) the old directory aside, the partial in place
fault = {"move": Fault("rename", None, kill=True, path_contains=".fp-partial"),
         "latest": Fault("write", None, kill=True, path_contains=".fp-partial"),
         "between-renames": Fault("rename", None, kill=True, at=4, path_contains="last.ckpt")}[where]
ck = fp.Checkpointer(stage, comm="local", backend=FaultyBackend([fault]))
ck.save(5, {"w": torch.full((50_000,), 5.0), "i": 5}, directory=target).wait()
"""


@pytest.mark.parametrize("where", ["move", "latest", "between-renames"])
def test_a_kill_while_publishing_leaves_the_previous_checkpoint(tmp_path, where: str) -> None:
    """SIGKILL before the step directory moves, after it moved into the partial directory, and
    (on the path without RENAME_EXCHANGE) between the old directory's rename aside and the new
    one's into place: the previous checkpoint is still read under the directory's name, and the
    next directory save cleans up and publishes."""
    stage, target = str(tmp_path / "stage"), str(tmp_path / "last.ckpt")
    with fp.Checkpointer(stage, comm="local") as ck:
        ck.save(4, _state(4), directory=target).wait()
    env = dict(os.environ, PYTHONPATH=SRC)
    if where == "between-renames":
        env["FASTPERSIST_NO_RENAME_EXCHANGE"] = "1"
    proc = subprocess.run([sys.executable, "-c", _CHILD, stage, target, where], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    assert fp.load_checkpoint(directory_checkpoint(target))["i"] == 4  # read in place, nothing renamed
    assert os.path.lexists(target) == (where != "between-renames")
    # killed before the move: step 5 is committed in the staging root; after: in the partial
    staged = [c.step for c in fp.list_checkpoints(stage) if c.committed]
    assert staged == ([5] if where == "move" else [])
    assert os.path.isdir(os.path.join(target + PARTIAL_SUFFIX, "step-00000005")) == (where != "move")
    with fp.Checkpointer(stage, comm="local") as ck:
        ck.save(6, _state(6), directory=target).wait()
    assert fp.open(target).load()["i"] == 6
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "stage"]


def test_sweep_cleans_what_interrupted_publishes_left(tmp_path) -> None:
    """A framework's folder after crashes: a partial (removed), an old copy beside its
    checkpoint (removed), an old copy alone (put back under its name); a directory save never
    replaces a directory that is not a published checkpoint."""
    stage = str(tmp_path / ".stage")
    with fp.Checkpointer(stage, comm="local") as ck:
        for i, name in enumerate(["a", "b"]):
            ck.save(i, _state(i), directory=str(tmp_path / name)).wait()
    os.rename(tmp_path / "b", str(tmp_path / "b") + OLD_SUFFIX)  # b: between the two renames
    shutil.copytree(tmp_path / "a", str(tmp_path / "a") + OLD_SUFFIX)  # a: the old copy left beside it
    os.mkdir(str(tmp_path / "c") + PARTIAL_SUFFIX)
    sweep(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == [".stage", "a", "b"]
    assert fp.open(str(tmp_path / "b")).load()["i"] == 1
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("not a checkpoint")
    with fp.Checkpointer(stage, comm="local") as ck:
        with pytest.raises(CheckpointWriteError, match="not a checkpoint published by fastpersist"):
            ck.save(3, _state(3), directory=str(tmp_path / "mine")).wait()
    assert (tmp_path / "mine" / "notes.txt").read_text() == "not a checkpoint"
    with pytest.raises(CheckpointNotFoundError, match="holds no committed"):
        directory_checkpoint(str(tmp_path / "nothing"))


def _local_comm_rank(rank: int, world: int, root: str) -> tuple[int, int | None]:
    # Only rank 0 saves, through a Checkpointer of its own process: no collective, so the
    # other rank is not needed (a gloo Checkpointer would wait for it)
    if rank == 0:
        with fp.Checkpointer(root, comm="local") as ck:
            ck.save(3, _state(3)).wait()
            return ck.comm.world_size, ck.latest_step()
    return 0, None


def test_comm_local_in_a_distributed_job_saves_alone(tmp_path) -> None:
    root = str(tmp_path / "root")
    assert run_ranks(tmp_path, 2, _local_comm_rank, root) == [(1, 3), (0, None)]
    assert fp.open(root).load()["i"] == 3
    with pytest.raises(ValueError, match='"local"'):
        fp.Checkpointer(root, comm="gloo")


class _FailingDelete(fp.FileBackend):
    """Real files; deleting a path that contains ``refuse`` fails (a read-only or busy tree)."""

    def __init__(self, refuse: str) -> None:
        super().__init__()
        self.refuse = refuse
        self.deleted: list[str] = []

    def before_delete(self, path: str) -> None:
        self.deleted.append(path)
        if self.refuse in path:
            raise PermissionError(13, "Permission denied (test backend)", path)


@pytest.mark.parametrize("exchange", ["1", "0"])
def test_publishing_removes_the_replaced_checkpoint_through_the_backend(tmp_path, monkeypatch, exchange) -> None:
    """The checkpoint a directory save replaces is removed through the Checkpointer's backend
    (its failure hooks and throttles see it); a removal that fails leaves the new checkpoint
    published and is only logged."""
    monkeypatch.setenv("FASTPERSIST_NO_RENAME_EXCHANGE", "0" if exchange == "1" else "1")
    target = str(tmp_path / "last.ckpt")
    backend = _FailingDelete(refuse="never")
    with fp.Checkpointer(str(tmp_path / "stage"), comm="local", backend=backend) as ck:
        ck.save(1, _state(1), directory=target).wait()
        ck.save(2, _state(2), directory=target).wait()
        replaced = [p for p in backend.deleted if p.startswith(target)]
        assert replaced, backend.deleted  # the step-1 checkpoint's removal went through the backend
        backend.refuse = target
        ck.save(3, _state(3), directory=target).wait()
    assert fp.open(target).load()["i"] == 3
