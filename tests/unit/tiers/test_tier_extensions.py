"""The tiers' extensions of the save alone (no Checkpointer): the durable drain, and node-local
roots with copies on other nodes, on the save protocol with simulated ranks."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from cores import job, make_protocol
from ranks import on_ranks

import fastpersist as fp
from fastpersist.dist import Comm, LocalComm
from fastpersist.errors import CheckpointWriteError
from fastpersist.options import Durable
from fastpersist.saving.extension import Extension
from fastpersist.storage.faults import Fault, FaultyBackend, NodeLocal
from fastpersist.tiers.durable.extension import DurableDrain
from fastpersist.tiers.durable.store import open_store
from fastpersist.tiers.nodes.extension import NodeCopies
from fastpersist.topology import NodeMap


def drain(tmp_path: Any, every: int = 1) -> DurableDrain:
    root = str(tmp_path / "r")
    return DurableDrain(open_store(str(tmp_path / "durable")), [root], 0, Durable(str(tmp_path / "durable"), every),
                        "keep", 60.0, 0)


def test_the_drain_copies_due_commits_and_the_handle_says_so(tmp_path):
    ext = drain(tmp_path, every=2)
    p = make_protocol(LocalComm(), [str(tmp_path / "r")], [ext])
    jobs = [job(s, {"w": torch.full((100,), float(s))}, number=s) for s in (1, 2, 3)]
    for j in jobs:
        p.run(j)
        j.completion.finish()
    p.close()  # finishes the drains in flight
    assert [j.handle.durable.result(60) for j in jobs] == [True, False, True]  # every=2: 1, then 3
    durable = fp.open(str(tmp_path / "durable"))
    assert [i.step for i in durable.list() if i.committed] == [1, 3]
    assert torch.equal(durable.load(3)["w"], torch.full((100,), 3.0))


class _Watch(Extension):
    """Notes what the drain holds back when the save fails (it runs after the drain's hooks)."""

    name = "watch"

    def __init__(self, drain: DurableDrain) -> None:
        self.drain, self.held_at_failure = drain, None

    def failed(self, job, plan, outcome):  # type: ignore[no-untyped-def]
        self.held_at_failure = self.drain.protected()


def test_a_drain_taken_by_a_failed_commit_is_forgotten(tmp_path):
    """Rank 0 takes the step for the drain before the commit point (retention spares it from
    then on); the manifest's rename fails (injected): the step is never drained, and no longer
    held back."""
    ext = drain(tmp_path)
    backend = FaultyBackend([Fault("rename", path_contains="step-00000005")])
    watch = _Watch(ext)
    p = make_protocol(LocalComm(), [str(tmp_path / "r")], [ext, watch], backend=backend)
    j = job(5, {"w": torch.ones(10)})
    with pytest.raises(CheckpointWriteError, match="injected rename fault"):
        p.run(j)
    j.completion.finish(CheckpointWriteError("failed"))
    assert watch.held_at_failure == set() and ext.protected() == set()
    assert j.handle.durable.result(10) is False
    p.close()
    assert fp.open(str(tmp_path / "durable")).list() == []


def _two_nodes(tmp_path: Any, shared: bool) -> list[Any]:
    base = str(tmp_path / "nodes")
    ids = ["a", "a", "b", "b"]

    def rank(r: int, comm: Comm) -> Any:
        node = ids[r]
        root = os.path.join(base, "shared" if shared else node, "root")
        backend = NodeLocal(base, "shared" if shared else node)
        ext = NodeCopies(NodeMap.from_ids(ids), r, [root], backend, 2, comm.exchange)
        p = make_protocol(comm, [root], [ext], node_ids=ids, backend=backend, redundancy=2)
        try:
            p.run(job(1, {"w": torch.arange(50_000, dtype=torch.float32)}, rank_state={"mine": torch.full((9,), r)}))
        except CheckpointWriteError as e:
            return str(e)
        finally:
            p.close()
        return sorted(os.listdir(os.path.join(root, "step-00000001")))

    return on_ranks(4, rank)


def test_two_nodes_each_hold_every_byte(tmp_path):
    out = _two_nodes(tmp_path, shared=False)
    for r, files in enumerate(out):
        assert isinstance(files, list), files
    # node a holds its own ranks' rank_state and node b's copies (files named for the sender)
    a = out[0]
    assert any("rank-00002" in f for f in a) and any("rank-00003" in f for f in a), a
    for node in ("a", "b"):
        view = fp.open(os.path.join(str(tmp_path / "nodes"), node, "root"))
        assert view.verify(1) == []  # every extent has a copy under this node's roots
        assert torch.equal(view.load(1)["w"], torch.arange(50_000, dtype=torch.float32))
        for r in range(4):
            assert torch.equal(view.load_rank_state(1, rank=r)["mine"], torch.full((9,), r))


def test_roots_shared_by_two_nodes_are_refused_on_every_rank(tmp_path):
    out = _two_nodes(tmp_path, shared=True)
    assert all(isinstance(m, str) and "a filesystem shared by the nodes" in m for m in out), out


def test_one_copy_sends_nothing(tmp_path):
    ext = NodeCopies(NodeMap.from_ids(["a", "b"]), 0, [str(tmp_path)], NodeLocal(str(tmp_path), "a"), 1, None)
    assert ext.beside_write(job(1, {}), None, None) is None  # type: ignore[arg-type]
