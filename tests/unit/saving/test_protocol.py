"""The save protocol alone (no Checkpointer): its phases on simulated ranks, the order in which
it calls an extension's hooks, the parts it carries for extensions it does not know, and what
a failure in each phase leaves behind."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from cores import job, make_protocol
from ranks import on_ranks

import fastpersist as fp
from fastpersist.dist import Comm, LocalComm
from fastpersist.errors import CheckpointWriteError
from fastpersist.saving.extension import Beside, Extension, Writer, Written, parts_of, run_beside
from fastpersist.saving.job import SaveJob
from fastpersist.saving.messages import Committed, Proposal, RankReport, SavePlan  # noqa: F401


class Recorder(Extension):
    """Notes every hook the protocol calls, with what it saw; puts a part in every message."""

    name = "recorder"

    def __init__(self, fail_at: str | None = None) -> None:
        self.calls: list[str] = []
        self.seen: dict[str, Any] = {}
        self.fail_at = fail_at

    def _note(self, hook: str) -> None:
        self.calls.append(hook)
        if hook == self.fail_at:
            raise CheckpointWriteError(f"{self.name} refuses at {hook}")

    def start(self, job: SaveJob) -> None:
        self._note("start")

    def propose(self, job: SaveJob) -> Any:
        self._note("propose")
        return ("proposed-by", self.core.comm.rank)

    def plan(self, job: SaveJob, proposals: Sequence[Proposal], plan: SavePlan) -> SavePlan:
        self._note("plan")
        self.seen["proposals"] = parts_of(proposals, self.name)
        return plan

    def prepare(self, job: SaveJob, proposals: Sequence[Proposal]) -> None:
        self._note("prepare")

    def beside_write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Beside:
        self._note("beside_write")
        return run_beside(self.name, Written)  # nothing written beside, no part: write() gives it

    def write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Written:
        self._note("write")
        path = os.path.join(writer.roots[0], plan.directory, f"{plan.save_id}-{self.name}-{writer.rank}.bin")
        return Written((writer.write_replicated(plan, [], 0, path),), part=("wrote", writer.rank))

    def check(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport]) -> None:
        self._note("check")
        self.seen["reports"] = parts_of(written, self.name)

    def decide(self, job: SaveJob, plan: SavePlan) -> Any:
        self._note("decide")
        return "decided"

    def committed(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport], outcome: Committed) -> None:
        self._note("committed")
        self.seen["outcome"] = outcome.parts.get(self.name)

    def failed(self, job: SaveJob, plan: SavePlan | None, outcome: Committed | None) -> None:
        self.calls.append("failed")


def state() -> dict[str, Any]:
    return {"w": torch.arange(300_000, dtype=torch.float32), "b": torch.ones(7), "step": 3}


def test_one_rank_runs_every_phase_and_hook_in_order(tmp_path):
    rec = Recorder()
    p = make_protocol(LocalComm(), [str(tmp_path / "a"), str(tmp_path / "b")], [rec])
    j = job(3, state())
    p.run(j)
    assert rec.calls == ["start", "propose", "plan", "prepare", "beside_write", "write", "check", "decide",
                         "committed"]
    assert rec.seen["proposals"] == [("proposed-by", 0)]
    assert rec.seen["reports"] == [("wrote", 0)]
    assert rec.seen["outcome"] == "decided"
    loaded = fp.open([str(tmp_path / "a"), str(tmp_path / "b")]).load(3)
    assert torch.equal(loaded["w"], state()["w"]) and loaded["step"] == 3
    manifest = fp.open([str(tmp_path / "a"), str(tmp_path / "b")]).manifest(3)
    assert any("-recorder-0.bin" in f.name for f in manifest.files)  # an extension's file is in the checkpoint
    assert j.metrics.total_s > 0 and j.metrics.bytes_total > 0


def test_two_simulated_ranks_agree_and_carry_each_ranks_part(tmp_path):
    roots = [str(tmp_path / "r")]

    def rank(r: int, comm: Comm) -> Any:
        rec = Recorder()
        make_protocol(comm, roots, [rec]).run(job(5, state()))
        return rec.seen

    out = on_ranks(2, rank)
    for seen in out:
        assert not isinstance(seen, BaseException), seen
        assert seen["proposals"] == [("proposed-by", 0), ("proposed-by", 1)]
        assert seen["outcome"] == "decided"  # rank 0 decided, every rank heard it
    assert fp.open(roots).verify(5) == []


@pytest.mark.parametrize("hook", ["propose", "plan", "write", "check", "decide"])
def test_a_refusal_before_the_commit_point_leaves_nothing_on_any_rank(tmp_path, hook):
    """An extension that refuses in one phase: every rank raises naming it, no manifest exists
    and no file of the save is left in the roots. A hook inside a phase's all-gather (propose,
    write, decide) refuses on one rank (rank 1; decide runs on rank 0 only) and every rank
    hears it; plan and check decide alike on every rank (they see the same messages)."""
    roots = [str(tmp_path / "r")]
    alike = hook in ("plan", "check")

    def rank(r: int, comm: Comm) -> Any:
        rec = Recorder(fail_at=hook if alike or r == 1 or hook == "decide" else None)
        p = make_protocol(comm, roots, [rec])
        try:
            p.run(job(7, state()))
        except CheckpointWriteError as e:
            return str(e), rec.calls
        return "committed", rec.calls

    out = on_ranks(2, rank)
    for msg, calls in out:
        assert f"refuses at {hook}" in msg, msg
        assert ("failed" in calls) == (hook in ("write", "check", "decide")), calls
    step_dir = os.path.join(roots[0], "step-00000007")
    assert not os.path.exists(os.path.join(step_dir, "manifest.json"))
    assert not os.path.isdir(step_dir) or os.listdir(step_dir) == []


class BesideFails(Recorder):
    def beside_write(self, job: SaveJob, plan: SavePlan, writer: Writer) -> Beside:
        self._note("beside_write")

        def fail() -> Written:
            raise CheckpointWriteError("the work beside the writes failed")

        return run_beside(self.name, fail)


@pytest.mark.parametrize("hook", ["start", "beside_write"])
def test_a_refusal_at_the_start_or_beside_the_writes_leaves_nothing(tmp_path, hook):
    """start decides alike on every rank (a first save's collective checks); work beside the
    writes fails the write phase on every rank once the rank's own writes have ended."""
    roots = [str(tmp_path / "r")]

    def rank(r: int, comm: Comm) -> Any:
        rec = BesideFails() if hook == "beside_write" and r == 1 else Recorder(fail_at="start" if hook == "start"
                                                                                else None)
        p = make_protocol(comm, roots, [rec])
        with pytest.raises(CheckpointWriteError, match="refuses at start|beside the writes failed"):
            p.run(job(7, state()))
        return rec.calls

    out = on_ranks(2, rank)
    assert all(("failed" in calls) == (hook == "beside_write") for calls in out), out
    assert fp.open(roots).list() == []


class FailsAfterTheCommit(Recorder):
    name = "fails-after"

    def committed(self, job: SaveJob, plan: SavePlan, written: Sequence[RankReport], outcome: Committed) -> None:
        self._note("committed")
        if job.step == 2:
            raise CheckpointWriteError("the named directory could not take it")

    def failed(self, job: SaveJob, plan: SavePlan, outcome: Committed | None) -> None:
        raise RuntimeError("a failed hook that fails is logged, not raised")


def test_a_hook_that_fails_after_the_commit_lets_the_others_and_retention_run(tmp_path):
    """The checkpoint stays committed; every later hook runs, then retention; the first error is
    raised then (the save's handle fails)."""
    root = str(tmp_path / "r")
    after = Recorder()
    p = make_protocol(LocalComm(), [root], [FailsAfterTheCommit(), after], keep=1)
    p.run(job(1, state(), number=1))
    j = job(2, state(), number=2)
    with pytest.raises(CheckpointWriteError, match="could not take it"):
        p.run(j)
    p.coordinator.janitor.drain()
    assert after.calls.count("committed") == 2  # the later extension still heard of the commit
    assert [i.step for i in fp.open(root).list()] == [2]  # committed, and retention ran (keep=1)
    assert j.metrics.total_s > 0


def test_a_failed_hook_that_raises_does_not_stop_the_cleanup(tmp_path):
    root = str(tmp_path / "r")
    p = make_protocol(LocalComm(), [root], [FailsAfterTheCommit(fail_at="check")])
    with pytest.raises(CheckpointWriteError, match="refuses at check"):  # the save's own error
        p.run(job(1, state()))
    assert fp.open(root).list() == [] and os.listdir(root) == [".fastpersist.lock"]  # the save's files removed


def test_ranks_whose_extensions_differ_are_refused_alike(tmp_path):
    roots = [str(tmp_path / "r")]

    def rank(r: int, comm: Comm) -> Any:
        p = make_protocol(comm, roots, [Recorder()] if r == 0 else [])
        with pytest.raises(CheckpointWriteError, match="disagree on recorder="):
            p.run(job(1, state()))
        return "refused"

    assert on_ranks(2, rank) == ["refused", "refused"]


def test_ranks_out_of_step_stop_every_later_save(tmp_path):
    roots = [str(tmp_path / "r")]

    def rank(r: int, comm: Comm) -> Any:
        p = make_protocol(comm, roots)
        with pytest.raises(CheckpointWriteError, match="out of step"):
            p.run(job(2, state(), number=1 + r))
        with pytest.raises(CheckpointWriteError, match="out of step"):  # no collective: nobody waits
            p.run(job(3, state(), number=2 + r))
        return p.broken is not None

    assert on_ranks(2, rank) == [True, True]


def test_retention_spares_what_the_extensions_hold(tmp_path):
    class Holds(Extension):
        name = "holds"

        def protected(self) -> set[int]:
            return {1}

    root = str(tmp_path / "r")
    p = make_protocol(LocalComm(), [root], [Holds()], keep=1)
    for step in (1, 2, 3):
        p.run(job(step, state(), number=step))
    p.coordinator.janitor.drain()
    assert [i.step for i in fp.open(root).list()] == [1, 3]  # 2 deleted; 1 held by the extension
    p.close()
