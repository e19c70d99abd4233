"""The process engine (``Checkpointer(engine="process")``): real save processes, real shared
memory, real gloo groups of save processes, real SIGKILLs and signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from helpers import assert_state_equal, fsdp_mlp, gathered, run_ranks, states_equal

import fastpersist as fp
from fastpersist.errors import CheckpointWriteError, ReplicaMismatchError

SUPPORT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.ReLU(), torch.nn.Linear(96, 5))
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    m(torch.randn(8, 64)).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _copy(m: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    return gathered({"model": m.state_dict(), "optim": opt.state_dict(), "step": step})


class Note:  # not plain: pickled in save(), in the training process
    def __init__(self, text: str) -> None:
        self.text = text


def _gone(pid: int, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True  # exited; its parent has not reaped it yet
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("mode", ["snapshot", "overlap", "sync"])
def test_saves_through_the_save_process_are_the_state_at_the_call(tmp_path, mode):
    """Each checkpoint equals the state at its save() bit for bit, though training goes on
    while the save process writes it; rank state, metadata, a state that is not plain and
    save(directory=) go through; the metrics come back; close() ends the save process."""
    m, opt = _model()
    ck = fp.Checkpointer(str(tmp_path / "ck"), engine="process", mode=mode, keep=2)
    ck.protect(opt)
    pid = ck._remote.pid
    assert pid != os.getpid()
    expected = {}
    for step in range(4):
        _train(m, opt)
        h = ck.save(step, {"model": m, "optim": opt, "step": step}, rank_state={"note": Note(f"n{step}")},
                    metadata={"loss": step / 2}, directory=str(tmp_path / "best") if step == 2 else None)
        expected[step] = _copy(m, opt, step)
        _train(m, opt)  # training goes on while the save process writes (overlap: the step waits)
    metrics = h.result()
    assert metrics.bytes_written > 0 and metrics.bytes_total == metrics.bytes_written and metrics.write_s > 0
    assert h.durable.result(30) is False  # no durable tier
    ck.wait()
    assert [c.step for c in ck.list()] == [1, 3]  # retention ran in the save process; step 2 was moved
    for step in (1, 3):
        assert_state_equal(gathered(ck.load(step)), expected[step])
        assert ck.load_rank_state(step, weights_only=False)["note"].text == f"n{step}"
        assert ck.metadata(step) == {"loss": step / 2}
    assert_state_equal(gathered(fp.load_checkpoint(str(tmp_path / "best" / "step-00000002"))), expected[2])
    assert ck.history.saves == 4
    ck.close()
    assert _gone(pid, 30)


def test_overlap_moves_the_optimizers_tensors_into_shared_memory_once(tmp_path):
    """Overlap mode: the protected optimizer's tensors move into shared memory at the first
    save (the model keeps training on them) and are not copied again; a state entry created
    later and a parameter whose storage the job replaced move at the next save, and what is
    saved is what they hold."""
    m, opt = _model()
    ck = fp.Checkpointer(str(tmp_path / "ck"), engine="process", mode="overlap", keep=1)
    ck.protect(opt)
    _train(m, opt)
    ck.save(1, {"model": m, "optim": opt}).result()
    sharing = ck._saver.sharing
    assert len(sharing.regions) == 1
    first = m[0].weight.data_ptr()
    assert sharing.regions[0].holds(first)
    h = ck.save(2, {"model": m, "optim": opt})
    assert h.metrics.bytes_copied < 4096 and len(sharing.regions) == 1  # nothing copied: written in place
    h.result()
    m[2].weight.data = torch.full_like(m[2].weight, 7.0)  # the job replaces a storage
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    opt.param_groups[-1]["params"][0].grad = torch.ones(3)
    opt.step()  # a new parameter and its new state entries
    expected = _copy(m, opt, 0)
    ck.save(3, {"model": m, "optim": opt, "step": 0}).result()
    assert len(sharing.regions) == 2 and sharing.regions[1].holds(m[2].weight.data_ptr())
    assert_state_equal(gathered(ck.load(3)), expected)
    with torch.no_grad():  # every tensor replaced: the old regions are let go, on both sides
        for p in [p for group in opt.param_groups for p in group["params"]]:
            p.data = p.data.clone()
        for st in opt.state.values():
            for k in list(st):
                st[k] = st[k].clone()
    ck.save(4, {"model": m, "optim": opt}).result()
    assert [r.number for r in sharing.regions] == [3]
    ck.close()


def test_a_reply_that_comes_before_the_save_thread_asks_for_it_is_kept(tmp_path):
    """The save process may commit a save before training's save thread comes to wait for it
    (the thread is busy: here, in an earlier save's done-callback); the reply waits for it."""
    import threading

    ck = fp.Checkpointer(str(tmp_path / "ck"), engine="process", max_in_flight=2)
    gate, held = threading.Event(), threading.Event()

    def hold(_):
        if threading.current_thread() is not threading.main_thread():
            held.set()
            gate.wait(60)

    for step in range(1, 20):  # until the callback ran in the save thread (not inline: already done)
        first = ck.save(step * 2, {"w": torch.full((1 << 20,), float(step))})
        first.add_done_callback(hold)
        if held.wait(30):
            break
    second = ck.save(step * 2 + 1, {"w": torch.ones(8)})
    manifest = tmp_path / "ck" / f"step-{step * 2 + 1:08d}" / "manifest.json"
    deadline = time.monotonic() + 60
    while not manifest.exists() and time.monotonic() < deadline:  # committed while the thread was held
        time.sleep(0.05)
    assert manifest.exists()
    gate.set()
    assert second.result(60).bytes_written > 0
    ck.close()


def test_the_save_process_killed_fails_saves_by_name_and_commits_nothing_partial(tmp_path):
    """SIGKILL of the save process: the save in flight and every later call raise an error
    naming it (its pid and the signal), within seconds; the last committed checkpoint stays
    the latest; a new Checkpointer starts a new save process and saves."""
    root = str(tmp_path / "ck")
    ck = fp.Checkpointer(root, engine="process")
    ck.save(1, {"w": torch.ones(1 << 20)}).result()
    pid = ck._remote.pid
    h = ck.save(2, {"w": torch.full((1 << 22,), 2.0)})
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(CheckpointWriteError) as e:
        h.result(60)
        ck.save(3, {"w": torch.ones(4)})  # if step 2 committed before the kill landed
    assert time.monotonic() - t0 < 30
    assert f"pid {pid}" in str(e.value) and "SIGKILL" in str(e.value)
    with pytest.raises(CheckpointWriteError, match=f"pid {pid}"):
        ck.save(4, {"w": torch.ones(4)})
    ck.close()  # the failure was raised already: not again
    again = fp.Checkpointer(root, engine="process")
    assert again.latest_step() in (1, 2)  # step 2 only if it committed before the kill
    assert torch.equal(again.load()["w"], torch.full((1 << 22,), 2.0) if again.latest_step() == 2 else torch.ones(1 << 20))
    again.save(5, {"w": torch.zeros(8)}).result()
    assert again.latest_step() == 5
    again.close()


@pytest.mark.parametrize("how", ["sigkill", "exit", "raise", "return"])
def test_a_training_process_that_dies_leaves_its_captured_save_committed(tmp_path, how):
    """The training process ends right after save() returned (SIGKILL, os._exit, an exception,
    a return without close()): its save process commits the save it holds, then exits; it
    never outlives that."""
    root, out = str(tmp_path / "ck"), str(tmp_path)
    run = subprocess.run([sys.executable, os.path.join(SUPPORT, "save_process_child.py"), how, root, out],
                         capture_output=True, text=True, timeout=180)
    expected = {"sigkill": -signal.SIGKILL, "exit": 3, "raise": 1, "return": 0}[how]
    assert run.returncode == expected, run.stderr[-3000:]
    _, saver = map(int, open(os.path.join(out, "pids")).read().split())
    assert _gone(saver), f"the save process {saver} outlived its training process"
    ck = fp.Checkpointer(root)
    assert ck.latest_step() == 2 and [c.step for c in ck.list() if c.committed] == [1, 2]
    assert torch.equal(ck.load()["w"], torch.full((1 << 19,), 2.0))


def test_sigterm_to_the_process_group_ends_both_and_leaves_only_committed_checkpoints(tmp_path):
    """SIGTERM to the job's process group (what torchrun and SLURM send): the training process
    ends, the save process finishes the save it holds and exits; the latest checkpoint loads;
    no directory without a commit stays a checkpoint."""
    root, out = str(tmp_path / "ck"), str(tmp_path)
    child = subprocess.Popen([sys.executable, os.path.join(SUPPORT, "save_process_child.py"), "loop", root, out],
                             start_new_session=True, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not os.path.exists(os.path.join(out, "looping")):
        assert child.poll() is None, child.stderr.read()[-3000:] if child.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _, saver = map(int, open(os.path.join(out, "pids")).read().split())
    os.killpg(child.pid, signal.SIGTERM)
    assert child.wait(60) == -signal.SIGTERM
    assert _gone(saver)
    ck = fp.Checkpointer(root)
    latest = ck.latest_step()
    assert latest is not None and latest >= 3
    assert torch.equal(ck.load()["w"], torch.full((1 << 19,), float(latest)))
    assert all(c.committed or c.abandoned for c in ck.list() if c.step != latest + 1)


def test_the_engine_from_the_environment_and_refusals_name_the_argument(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="engine must be one of"):
        fp.Checkpointer(str(tmp_path / "a"), engine="fork")
    monkeypatch.setenv("FASTPERSIST_ENGINE", "fork")
    with pytest.raises(ValueError, match="FASTPERSIST_ENGINE must be one of"):
        fp.Checkpointer(str(tmp_path / "a"))
    monkeypatch.setenv("FASTPERSIST_ENGINE", "process")
    from fastpersist.storage.backend import FileBackend

    assert fp.Checkpointer(str(tmp_path / "a"), backend=FileBackend()).engine == "thread"  # the backend is here
    chosen = fp.Checkpointer(str(tmp_path / "a"))
    assert chosen.engine == "process" and chosen._remote is not None
    chosen.close()
    monkeypatch.delenv("FASTPERSIST_ENGINE")
    assert fp.Checkpointer(str(tmp_path / "a")).engine == "thread"
    with pytest.raises(ValueError, match="backend"):
        fp.Checkpointer(str(tmp_path / "a"), engine="process", backend=FileBackend())
    ck = fp.Checkpointer(str(tmp_path / "a"), engine="process", snapshot_bytes=1 << 20)
    with pytest.raises(CheckpointWriteError, match="snapshot_bytes"):
        ck.save(1, {"w": torch.ones(1 << 20)})
    ck.save(2, {"w": torch.ones(1000)}).result()  # the Checkpointer goes on
    ck.close()


def test_the_save_process_runs_at_the_niceness_asked(tmp_path):
    ck = fp.Checkpointer(str(tmp_path / "n"), engine="process", config=fp.IOConfig(save_process_nice=7))
    ck.save(1, {"w": torch.ones(10)}).result()
    with open(f"/proc/{ck._remote.pid}/stat") as f:
        assert int(f.read().rsplit(") ", 1)[1].split()[16]) == 7  # field 19: nice
    ck.close()


def test_a_drain_runs_in_the_save_process_and_reports_back(tmp_path):
    """The durable tier drains from the save process; handle.durable completes in training."""
    ck = fp.Checkpointer(str(tmp_path / "fast"), engine="process", durable=str(tmp_path / "durable"))
    h = ck.save(3, {"w": torch.arange(1 << 16)})
    h.result()
    assert h.durable.result(60) is True
    ck.close()
    assert fp.Checkpointer(str(tmp_path / "durable")).latest_step() == 3


def _two_ranks(rank: int, world: int, root: str) -> dict:
    m, opt = _model()
    ck = fp.Checkpointer(root, engine="process", mode="overlap")
    ck.protect(opt)
    _train(m, opt)
    ck.save(1, {"model": m, "optim": opt}, rank_state={"rank": torch.full((100 + rank,), float(rank))})
    expected = _copy(m, opt, 1)
    _train(m, opt)
    ck.wait()
    try:
        ck.save(2, {"w": torch.full((10,), float(rank))}).result()
    except ReplicaMismatchError as e:  # the save processes' check, raised here as its own type
        mismatch = e.ranks
    else:
        mismatch = None
    ck.close()
    return {"expected": expected, "mismatch": mismatch}


def test_two_ranks_save_through_their_save_processes(tmp_path):
    """Two ranks (gloo): their save processes form a group of their own, write balanced shares,
    check the replicas and commit together; a mismatch comes back to each rank as its error."""
    root = str(tmp_path / "ck")
    results = run_ranks(tmp_path, 2, _two_ranks, root)
    assert [r["mismatch"] for r in results] == [[1], [1]]
    ck = fp.Checkpointer(root)
    assert ck.latest_step() == 1
    loaded = ck.load(1)
    assert_state_equal(gathered({"model": loaded["model"], "optim": loaded["optim"], "step": 1}),
                       results[0]["expected"])
    for r in range(2):
        assert torch.equal(ck.load_rank_state(1, rank=r)["rank"], torch.full((100 + r,), float(r)))


def _mixed_engines(rank: int, world: int, root: str) -> str:
    from fastpersist.storage.backend import FileBackend

    os.environ["FASTPERSIST_ENGINE"] = "process"  # rank 1's backend keeps it on the thread engine
    try:
        fp.Checkpointer(root, backend=FileBackend() if rank == 1 else None)
    except ValueError as e:
        return str(e)
    return "built"


def test_ranks_on_different_engines_are_refused_on_every_rank(tmp_path):
    messages = run_ranks(tmp_path, 2, _mixed_engines, str(tmp_path / "ck"))
    assert all("engine: the ranks run different engines (['process', 'thread'] by rank" in m for m in messages), messages


def _fsdp_ranks(rank: int, world: int, root: str) -> dict:
    m, opt = fsdp_mlp(world)
    torch.manual_seed(1 + rank)
    m(torch.randn(8, 48)).sum().backward()
    opt.step()
    with fp.Checkpointer(root, engine="process", mode="overlap") as ck:
        ck.protect(opt)  # DTensors stay where FSDP2 keeps them: copied at each save
        ck.save(7, {"model": m, "optim": opt, "step": 7})
        full = gathered({"model": m.state_dict(), "optim": opt.state_dict(), "step": 7})
        m(torch.randn(8, 48)).sum().backward()
        opt.step()
    return full


def test_fsdp2_state_saves_through_the_save_processes(tmp_path):
    root = str(tmp_path / "ck")
    full = run_ranks(tmp_path, 2, _fsdp_ranks, root)[0]
    ck = fp.Checkpointer(root)
    assert states_equal(gathered(ck.load(7)), full)
    assert dist.is_available()
