"""The save's extensions (incremental reuse, the replica check, publishing into a directory)
alone: each on the save protocol without a Checkpointer, or its hooks given messages made here."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cores import job, make_protocol
from ranks import on_ranks

import fastpersist as fp
from fastpersist.dist import Comm, LocalComm
from fastpersist.errors import CheckpointWriteError, ReplicaMismatchError
from fastpersist.format import manifest as mf
from fastpersist.objects import dtensor
from fastpersist.objects.write import prepare
from fastpersist.saving.extensions.incremental import IncrementalSaves, Probed
from fastpersist.saving.extensions.publish import Publish
from fastpersist.saving.extensions.replicas import ReplicaCheck
from fastpersist.saving.messages import Proposal, RankReport, SavePlan
from fastpersist.storage.faults import Fault, FaultyBackend


def proposals(name: str, parts: list[Any]) -> list[Proposal]:
    return [Proposal("d", "id", 1, 1, (), {name: p}) for p in parts]


def plan_of(state: Any) -> SavePlan:
    rep = prepare(mf.REPLICATED, state)
    return SavePlan(1, "step-00000001", "id", ((0, 0),), (), dtensor.assign([[]]), rep, None)


# ---------------------------------------------------------------------------------------------
# the replica check

def test_replica_check_names_the_first_differing_tensor_and_the_ranks():
    state = {"a": torch.ones(4), "b": {"c": torch.zeros(3)}}
    plan = plan_of(state)
    ext = ReplicaCheck()
    same = [RankReport((), {}, {"replicas": ([1, 2], {})}) for _ in range(3)]
    ext.check(job(1, state), plan, same)  # equal digests: nothing raised
    differ = same[:2] + [RankReport((), {}, {"replicas": ([1, 9], {})})]
    with pytest.raises(ReplicaMismatchError, match=r"state\['b.c'\] on rank 2 differs from rank 0"):
        ext.check(job(1, state), plan, differ)


def test_replica_check_on_simulated_ranks_fails_every_rank_and_commits_nothing(tmp_path):
    root = str(tmp_path / "r")

    def rank(r: int, comm: Comm) -> str:
        state = {"w": torch.full((1000,), float(r == 1))}  # rank 1 holds other values
        p = make_protocol(comm, [root], [ReplicaCheck()])
        with pytest.raises(ReplicaMismatchError, match=r"state\['w'\] on rank 1"):
            p.run(job(4, state))
        return "refused"

    assert on_ranks(2, rank) == ["refused", "refused"]
    assert fp.open(root).list() == []


# ---------------------------------------------------------------------------------------------
# incremental saves

def test_incremental_refuses_ranks_with_other_unit_sizes():
    ext = IncrementalSaves(0, 2, 1 << 20)
    with pytest.raises(CheckpointWriteError, match="disagree on incremental=: rank 1 uses 2097152"):
        ext.plan(job(1, {}), proposals("incremental", [Probed(1 << 20), Probed(2 << 20)]), plan_of({}))


def test_incremental_reuses_what_did_not_change_and_relinks_it(tmp_path):
    root = str(tmp_path / "r")
    ext = IncrementalSaves(0, 1, 1 << 20)
    p = make_protocol(LocalComm(), [root], [ext])
    frozen, trained = torch.arange(1 << 20, dtype=torch.float32), torch.zeros(1 << 18)
    first = job(1, {"frozen": frozen, "trained": trained})
    p.run(first)
    trained += 1
    second = job(2, {"frozen": frozen, "trained": trained}, number=2)
    p.run(second)
    assert second.metrics.bytes_reused == frozen.nbytes  # the frozen tensor's 4 MiB: linked, not written
    assert second.metrics.bytes_written < trained.nbytes + 4096
    got = fp.open(root).load(2)
    assert torch.equal(got["frozen"], frozen) and torch.equal(got["trained"], trained)
    linked = [f for f in os.listdir(os.path.join(root, "step-00000002")) if "reused" in f]
    assert linked and os.stat(os.path.join(root, "step-00000002", linked[0])).st_nlink == 2


def test_incremental_forgets_its_reference_when_a_save_fails(tmp_path):
    """A save that fails at its commit (the manifest's rename, injected) leaves no reference:
    the next save writes everything rather than link files the failed save may have removed."""
    root = str(tmp_path / "r")
    ext = IncrementalSaves(0, 1, 1 << 20)
    backend = FaultyBackend([Fault("rename", path_contains="step-00000002")])
    p = make_protocol(LocalComm(), [root], [ext], backend=backend)
    w = torch.ones(1 << 18)
    p.run(job(1, {"w": w}))
    assert ext.reuse.has_reference
    with pytest.raises(CheckpointWriteError, match="injected rename fault"):
        p.run(job(2, {"w": w}, number=2))
    assert not ext.reuse.has_reference
    third = job(3, {"w": w}, number=3)
    p.run(third)
    assert third.metrics.bytes_reused == 0 and third.metrics.bytes_written >= w.nbytes


# ---------------------------------------------------------------------------------------------
# publishing into a named directory

@pytest.mark.parametrize("roots,nodes,durable,why", [(2, 1, False, "several roots"), (1, 2, False, "several nodes"),
                                                     (1, 1, True, "durable tier")])
def test_publish_refuses_what_cannot_be_one_directory(tmp_path, roots, nodes, durable, why):
    with pytest.raises(ValueError, match=why):
        Publish(roots, nodes, durable).target(tmp_path / "x")
    with pytest.raises(TypeError, match="directory must be a path"):
        Publish(1, 1, False).target(3)


def test_publish_refuses_a_directory_given_on_some_ranks_only():
    ext = Publish(1, 1, False)
    with pytest.raises(CheckpointWriteError, match=r"rank\(s\) \[1\] only"):
        ext.plan(job(1, {}), proposals("publish", [False, True]), plan_of({}))
    ext.plan(job(1, {}), proposals("publish", [True, True]), plan_of({}))  # every rank: fine


def test_publish_moves_the_commit_out_of_the_roots_and_retention_stops_counting_it(tmp_path):
    root, target = str(tmp_path / "r"), str(tmp_path / "published")
    p = make_protocol(LocalComm(), [root], [Publish(1, 1, False)], keep=1)
    p.run(job(1, {"w": torch.ones(10)}))
    p.run(job(2, {"w": torch.full((10,), 2.0)}, number=2, directory=target))
    p.coordinator.janitor.drain()
    assert [i.step for i in fp.open(root).list()] == [1]  # kept: the published step is not counted
    assert torch.equal(fp.open(target).load()["w"], torch.full((10,), 2.0))
