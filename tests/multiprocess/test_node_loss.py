"""Node loss for real: a training job on simulated nodes (tests/node_train_child.py) checkpoints
every step; a rank of one node SIGKILLs itself at a randomly chosen file operation (a data write,
an fsync, the manifest's rename, a retention deletion: mid-write, mid-commit or mid-retention),
its node's other ranks and then the rest of the job are killed as an elastic agent would, the
lost node's disks are deleted, and the job restarts on a replacement node with empty disks.
Every loss after the resume equals the uninterrupted run's, bit for bit."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import SUPPORT, free_port

CHILD = os.path.join(SUPPORT, "node_train_child.py")
STEPS = 10


class Job:
    """``world`` rank processes of node_train_child.py; rank 0's lines collected as they come."""

    def __init__(self, base: str, kind: str, world: int, per_node: int, names: list[str] | None = None,
                 kill: dict[int, str] | None = None) -> None:
        port = free_port()
        self.lines: list[str] = []
        self.seen = threading.Condition()
        self.procs = []
        for rank in range(world):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port), OMP_NUM_THREADS="1")
            if kill and rank in kill:
                env["NODE_SIM_KILL"] = kill[rank]
            args = [sys.executable, CHILD, base, str(STEPS), kind, str(per_node)] + ([",".join(names)] if names else [])
            self.procs.append(subprocess.Popen(args, env=env, stdout=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                                               stderr=subprocess.PIPE, text=True))
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        out = self.procs[0].stdout
        assert out is not None
        for line in out:
            with self.seen:
                self.lines.append(line.strip())
                self.seen.notify_all()

    def wait_for_death(self, ranks: list[int], timeout: float = 300.0) -> None:
        """Until one of ``ranks`` is killed (by its planned fault)."""
        deadline = time.monotonic() + timeout
        while True:
            dead = [r for r in ranks if self.procs[r].poll() is not None]
            if dead:
                code = self.procs[dead[0]].returncode
                assert code == -signal.SIGKILL, f"rank {dead[0]} exited with {code}, not its planned SIGKILL: " \
                                                 f"{self.errors()}"
                return
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"no rank of {ranks} reached its planned fault: {self.lines[-3:]}")
            try:
                self.procs[ranks[0]].wait(0.5)
            except subprocess.TimeoutExpired:
                pass

    def kill(self, ranks: list[int]) -> None:
        for r in ranks:
            self.procs[r].send_signal(signal.SIGKILL)

    def finish(self, timeout: float = 600.0) -> None:
        for p in self.procs:
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(list(range(len(self.procs))))
                raise AssertionError(f"the job hung: {self.errors()}") from None
        self.reader.join()  # ends with the process's output
        bad = [(r, p.returncode) for r, p in enumerate(self.procs) if p.returncode != 0]
        assert not bad, f"ranks exited abnormally {bad}: {self.errors()}"

    def stop(self) -> None:
        self.kill(list(range(len(self.procs))))
        for p in self.procs:
            p.wait(60)
        self.reader.join()  # ends with the process's output

    def errors(self) -> str:
        out = []
        for r, p in enumerate(self.procs):
            if p.poll() is not None and p.returncode not in (0, -signal.SIGKILL) and p.stderr is not None:
                out.append(f"--- rank {r} ---\n{p.stderr.read()[-3000:]}")
        return "\n".join(out)

    def losses(self) -> dict[int, str]:
        return {int(line.split()[1]): line.split()[3] for line in self.lines if line.startswith("step ")}

    def resumed(self) -> int | None:
        found = [int(line.split()[-1]) for line in self.lines if line.startswith("resumed from step")]
        return found[0] if found else None


_REFERENCES: dict[tuple[str, int], dict[int, str]] = {}


def _reference(kind: str, world: int) -> dict[int, str]:
    """The uninterrupted run's losses (one run per kind and world size in a session)."""
    if (kind, world) not in _REFERENCES:
        job = Job("none", kind, world, world)
        job.finish()
        _REFERENCES[(kind, world)] = job.losses()
    return _REFERENCES[(kind, world)]


def _lose_a_node(tmp_path, kind: str, world: int, per_node: int, seed: int, fewer: bool = False) -> None:
    """Lose a node at a planned random fault; restart on a replacement node with empty disks
    (``fewer``: without it, on the other nodes only, the state resharded over fewer ranks)."""
    rng = random.Random(seed)
    reference = _reference(kind, world)
    assert len(reference) == STEPS
    base = str(tmp_path / "nodes")
    lost = rng.randrange(1, world // per_node)
    ranks = list(range(lost * per_node, (lost + 1) * per_node))
    # the fault: the n-th such operation of a rank of the lost node (each rank does at least
    # that many before the last step: every save writes, fsyncs and, on a leader, renames)
    op, n = rng.choice([("write", rng.randrange(6, 14)), ("fsync", rng.randrange(10, 20)),
                        ("rename", rng.randrange(3, 8)), ("delete", rng.randrange(1, 4))])
    job = Job(base, kind, world, per_node, kill={r: f"{op}:{n}" for r in ranks})
    job.wait_for_death(ranks)  # the node is lost...
    job.stop()  # ...and the job is restarted, as torchrun's agent does
    shutil.rmtree(os.path.join(base, f"node{lost}"), ignore_errors=True)  # with its disks
    before = job.losses()
    if fewer:
        names = [f"node{i}" for i in range(world // per_node) if i != lost]
        again = Job(base, kind, world - per_node, per_node, names)
    else:
        again = Job(base, kind, world, per_node)  # a replacement node, empty disks
    again.finish()
    resumed = again.resumed()  # None: the node was lost before the first commit; the job starts over
    assert resumed is None or (resumed <= max(before) and max(before) - resumed <= 2), (op, n, resumed, sorted(before))
    after = again.losses()
    assert sorted(after) == list(range(0 if resumed is None else resumed + 1, STEPS))
    for step, loss in after.items():
        assert loss == reference[step], f"step {step}: {loss} after losing node {lost}, {reference[step]} without"


@pytest.mark.parametrize("world,per_node,fewer", [(4, 2, False), (4, 1, True)])
def test_a_lost_node_loses_nothing(tmp_path, world, per_node, fewer):
    """2 nodes of 2 ranks, a replacement node; 4 nodes of 1 rank, restarted on the 3 others."""
    _lose_a_node(tmp_path, "replicated", world, per_node, seed=world * 10 + per_node, fewer=fewer)


def test_a_lost_node_loses_no_sharded_state(tmp_path):
    _lose_a_node(tmp_path, "fsdp", 4, 2, seed=7)


@pytest.mark.long
@pytest.mark.parametrize("seed", range(6))
def test_a_lost_node_at_random_instants_long(tmp_path, seed):
    kind = "replicated" if seed % 2 else "fsdp"
    _lose_a_node(tmp_path, kind, 4, 1 + seed % 2, seed=100 + seed, fewer=kind == "replicated" and seed % 4 == 1)
