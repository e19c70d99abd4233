"""Checkpoints in the background: consistency in every mode, the optimizer guard, back-pressure,
retention, errors that surface, and a real SIGKILL in the middle of a write."""

from __future__ import annotations

import copy
import errno
import os
import random
import signal
import subprocess
import sys
import threading

import pytest
from helpers import SUPPORT, HeldBackend, blocked, wait_until
from helpers import states_equal as _same
import torch

import fastpersist as fp
from fastpersist.checkpointer import Checkpointer, list_checkpoints
from fastpersist.storage.backend import FileBackend
from fastpersist.options import Retention
from fastpersist.timeline import Commit
from fastpersist.state import RNGState

MODES = ["sync", "snapshot", "overlap"]
HERE = SUPPORT  # the child programs


class Failing(FileBackend):
    """Real files; every write request raises ``fail`` while it is set."""

    def __init__(self) -> None:
        self.fail: OSError | None = None

    def before_write(self, root: int, path: str, offset: int, nbytes: int) -> None:
        if self.fail is not None:
            raise self.fail


def _thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    """A started thread running ``fn``, and the list its exception (if any) lands in."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def _training(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.BatchNorm1d(256), torch.nn.ReLU(),
                                torch.nn.Linear(256, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)

    def step() -> None:
        x = torch.randn(16, 64)  # consumes the RNG
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    step()
    return model, opt, sched, step


def _snapshot(model, opt, sched) -> dict:
    return copy.deepcopy({"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                          "rng": torch.get_rng_state(), "py": random.getstate()})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [2 << 30, 4096], ids=["in-budget", "over-budget"])
def test_checkpoint_is_the_state_at_save_time(tmp_path, small_io, mode, budget):
    """Training goes on right after save(); the checkpoint must still be the state at save().

    Where save() returns before the write (in budget, snapshot and overlap), the data writes
    are held until training has moved on: three whole steps in snapshot mode; in overlap mode
    the first step's forward and backward (BatchNorm buffers change), up to the optimizer step,
    whose guard waits for the write. Over the budget, and in sync mode, save() writes inline."""
    model, opt, sched, step = _training()
    inline = mode == "sync" or budget == 4096
    backend = HeldBackend(hold="step-00000001")
    if inline:
        backend.release()  # save() returns committed: nothing to hold
    ck = Checkpointer(str(tmp_path / "ck"), mode=mode, snapshot_bytes=budget, backend=backend, config=small_io)
    at_step = threading.Event()
    opt.register_step_pre_hook(lambda *_: at_step.set())  # registered first: runs before the guard
    if mode == "overlap":
        ck.protect(opt)
    expected = _snapshot(model, opt, sched)
    handle = ck.save(1, {"model": model, "optim": opt, "sched": sched}, rank_state={"rng": RNGState()})
    assert handle.metrics.inline == inline
    if not inline:
        assert backend.holding.wait(30) and not handle.done()
    # parameters, moments, BatchNorm buffers, scheduler and RNG all move on
    training, errors = _thread(lambda: [step() for _ in range(3)])
    if mode == "overlap" and not inline:
        assert at_step.wait(30) and not handle.staged.done()
    else:
        training.join(60)
        assert not training.is_alive() and (inline or not handle.done())  # three steps, the write held
    backend.release()
    training.join(60)
    assert not training.is_alive() and errors == []
    after = _snapshot(model, opt, sched)
    assert not _same(after["model"], expected["model"]) and not _same(after["rng"], expected["rng"])
    handle.wait()
    ck.close()
    restored = _training(seed=1)
    assert not _same(restored[0].state_dict(), expected["model"])
    ck2 = Checkpointer(str(tmp_path / "ck"))
    ck2.load(1, into={"model": restored[0], "optim": restored[1], "sched": restored[2]})
    ck2.load_rank_state(1, into={"rng": RNGState()})
    got = _snapshot(*restored[:3])
    for key in ("model", "optim", "sched", "rng", "py"):
        assert _same(got[key], expected[key]), key


def test_guarded_step_waits_for_the_write(tmp_path, small_io):
    """optimizer.step() after save() in overlap mode waits until the live tensors are written:
    with the write held, the step blocks inside optimizer.step() (it does not finish), and it
    finishes only after the write is released and the tensors are staged."""
    model, opt, sched, step = _training()
    backend = HeldBackend(hold="step-00000001")  # the data writes wait until the test releases them
    ck = Checkpointer(str(tmp_path / "ck"), mode="overlap", backend=backend, config=small_io)
    at_step = threading.Event()
    opt.register_step_pre_hook(lambda *_: at_step.set())  # registered first: runs before the guard
    ck.protect(opt)
    staged_when_stepped: list[bool] = []
    opt.register_step_post_hook(lambda *_: staged_when_stepped.append(handle.staged.done()))
    expected = _snapshot(model, opt, sched)
    handle = ck.save(1, {"model": model, "optim": opt})
    assert handle.metrics.bytes_copied < 4096  # only the BatchNorm buffers were copied
    assert backend.holding.wait(30) and not handle.done() and not handle.staged.done()
    stepping, errors = _thread(step)  # the guarded optimizer step must wait for the write
    wait_until(lambda: (at_step.is_set() and blocked(stepping)) or not stepping.is_alive())
    assert stepping.is_alive() and staged_when_stepped == [], \
        "the optimizer step ran while its tensors were being written"
    backend.release()
    stepping.join(30)
    assert not stepping.is_alive() and errors == [] and staged_when_stepped == [True]
    handle.wait()
    assert handle.metrics.step_wait_s > 0  # the step's wait is in the metrics
    got = Checkpointer(str(tmp_path / "ck")).load(1)
    assert _same(got["model"], expected["model"]) and _same(got["optim"], expected["optim"])


def test_without_the_guard_the_checkpoint_would_be_torn(tmp_path, small_io):
    """The control for the test above: the same sequence with the guard removed gives a
    checkpoint that is not the state at save() (so the guard is what makes it right). The
    checksums, computed as bytes pass through the writer, usually catch the tearing on load."""
    model, opt, sched, step = _training()
    backend = HeldBackend(hold="step-00000001")
    ck = Checkpointer(str(tmp_path / "ck"), mode="overlap", backend=backend, config=small_io)
    ck.protect(opt)
    opt._optimizer_step_pre_hooks.clear()  # the guard's hook removed, in torch's own registry
    expected = _snapshot(model, opt, sched)
    handle = ck.save(1, {"model": model, "optim": opt})
    assert backend.holding.wait(30)
    step()  # unguarded: runs while the write is held open
    backend.release()
    handle.wait()
    try:
        got = Checkpointer(str(tmp_path / "ck")).load(1)
    except fp.ChecksumMismatchError:
        return  # torn, and detected
    assert not _same(got["model"], expected["model"])


def test_back_pressure_skip_and_wait(tmp_path, small_io):
    state = {"w": torch.randn(100_000)}
    backend = HeldBackend(hold="step-00000001")  # the first checkpoint stays in flight until released
    ck = Checkpointer(str(tmp_path / "skip"), backend=backend, config=small_io, when_busy="skip")
    first = ck.save(1, state)
    assert backend.holding.wait(30)
    second = ck.save(2, state)
    assert second.done() and second.metrics.skipped and not first.done()
    backend.release()
    first.wait()
    ck.save(3, state).wait()
    assert [i.step for i in ck.list()] == [1, 3]
    assert [m.step for m in ck.history if m.skipped] == [2]

    backend = HeldBackend(hold="step-00000001")
    ck = Checkpointer(str(tmp_path / "wait"), backend=backend, config=small_io, when_busy="wait")
    first = ck.save(1, state)
    assert backend.holding.wait(30)
    me = threading.current_thread()

    def release_once_save_waits() -> None:
        try:
            wait_until(lambda: blocked(me))  # save(2) below waits for room
        finally:
            backend.release()

    releaser, errors = _thread(release_once_save_waits)
    second = ck.save(2, state)  # waits for the first, which is released only once this call waits
    releaser.join(60)
    assert errors == [] and first.done() and second.metrics.waited_for_previous
    ck.close()
    assert [i.step for i in ck.list()] == [1, 2]


def _live_params(ck: Checkpointer) -> list[torch.nn.Parameter]:
    """Three parameters (of values 1, 2, 3) of an optimizer ``ck`` protects (overlap mode):
    written from live memory, they need no snapshot arena, which a second snapshot would wait
    for until the first is committed; so several saves of them can be in flight at once."""
    params = [torch.nn.Parameter(torch.full((50_000,), float(s))) for s in (1, 2, 3)]
    ck.protect(torch.optim.SGD(params, lr=0.1))
    return params


def test_max_in_flight_allows_several(tmp_path, small_io):
    backend = HeldBackend(hold="step-00000001")  # the first stays in flight; the others queue behind it
    ck = Checkpointer(str(tmp_path / "ck"), mode="overlap", backend=backend, config=small_io, max_in_flight=3)
    params = _live_params(ck)
    handles = [ck.save(s, {"w": params[s - 1]}) for s in (1, 2, 3)]
    assert backend.holding.wait(30) and not any(h.done() for h in handles)
    assert not any(h.metrics.waited_for_previous for h in handles)
    backend.release()
    ck.wait()
    assert all(ck.load(s)["w"][0] == s for s in (1, 2, 3))


def test_retention_keeps_in_flight_and_latest(tmp_path, small_io):
    """keep=1 with three checkpoints in flight: each commit's retention runs while the later
    ones are still queued; it deletes only older committed ones."""
    backend = HeldBackend(hold="step-00000001")  # all three are in flight before the first commits
    ck = Checkpointer(str(tmp_path / "ck"), mode="overlap", keep=1, backend=backend, config=small_io,
                      max_in_flight=3)
    params = _live_params(ck)
    seen: list[list[int]] = []
    handles = [ck.save(s, {"w": params[s - 1]}) for s in (1, 2, 3)]
    for h in handles:  # a done-callback runs after the commit and its retention, before the next save
        h.add_done_callback(lambda h: seen.append([i.step for i in ck.list() if i.committed]))
    assert backend.holding.wait(30) and not any(h.done() for h in handles)
    backend.release()
    ck.close()
    assert seen == [[1], [2], [3]]
    assert [i.step for i in ck.list()] == [3]


def _commits(*steps: int) -> list[Commit]:
    """Commits of ``steps`` in this order (sequence 1, 2, ...)."""
    return [Commit(s, i + 1, 0.0) for i, s in enumerate(steps)]


def test_retention_policy():
    r = Retention(keep=2, every=10)
    assert r.to_delete(_commits(1, 2, 3, 10, 11, 12)) == [1, 2, 3]  # 10: every 10th; 11, 12: last 2
    assert r.to_delete(_commits(1, 2, 3, 10, 11, 12, 13)) == [1, 2, 3, 11]
    assert Retention(keep=1).to_delete(_commits(1, 2, 3), protected=[2]) == [1]  # in flight survives
    assert Retention().to_delete(_commits(1, 2, 3)) == []
    with pytest.raises(ValueError, match="keep"):
        Retention(keep=0)


def test_background_error_surfaces_everywhere(tmp_path, small_io):
    model, opt, sched, step = _training()
    backend = Failing()
    ck = Checkpointer(str(tmp_path / "ck"), mode="overlap", backend=backend, config=small_io)
    ck.protect(opt)
    ck.save(1, {"model": model}).wait()
    backend.fail = OSError(errno.EIO, "injected EIO")
    # from handle.wait()
    with pytest.raises(fp.CheckpointWriteError, match="injected EIO"):
        ck.save(2, {"model": model}).wait()
    # from the next save() (the handle's error not looked at)
    h = ck.save(3, {"model": model})
    assert isinstance(h.exception(), fp.CheckpointWriteError)
    backend.fail = None
    with pytest.raises(fp.CheckpointWriteError, match="injected EIO"):
        ck.save(4, {"model": model})  # raises step 3's failure, after queueing step 4 (ranks stay in step)
    ck.wait()
    assert ck.latest_step() == 4
    # from the guarded optimizer step
    backend.fail = OSError(errno.EIO, "injected EIO again")
    h = ck.save(5, {"model": model, "optim": opt})
    h.exception()
    with pytest.raises(fp.CheckpointWriteError, match="injected EIO again"):
        step()
    backend.fail = None
    step()  # reported once: training can go on
    ck.close()
    assert ck.latest_step() == 4 and [i.step for i in ck.list()] == [1, 4]


def test_full_disk_in_the_background(tmp_path, small_fs):
    ck = Checkpointer([small_fs], mode="snapshot")
    ck.save(1, {"x": torch.ones(256 * 1024)}).wait()
    h = ck.save(2, {"x": torch.ones(4 * 1024 * 1024)})  # 16 MiB on an 8 MiB tmpfs
    with pytest.raises(fp.CheckpointWriteError, match="No space left"):
        h.wait()
    ck.close()
    assert ck.latest_step() == 1 and torch.equal(ck.load()["x"], torch.ones(256 * 1024))


def test_snapshot_memory_stays_within_budget(tmp_path):
    budget = 1 << 20
    ck = Checkpointer(str(tmp_path / "ck"), mode="snapshot", snapshot_bytes=budget)
    ck.save(1, {"a": torch.ones(100_000)}).wait()  # 400 kB: snapshot
    assert ck.snapshot_memory <= budget
    h = ck.save(2, {"a": torch.ones(1_000_000)})  # 4 MB: over the budget, written inline
    assert h.done() and h.metrics.bytes_copied == 0
    assert ck.snapshot_memory <= budget
    assert torch.equal(ck.load(2)["a"], torch.ones(1_000_000))


def test_startup_cleans_leftovers(tmp_path):
    root = tmp_path / "ck"
    ck = Checkpointer(str(root))
    ck.save(1, {"x": torch.ones(3)}).wait()
    (root / "step-00000002").mkdir()
    (root / "step-00000002" / "abc-replicated-0000.bin").write_bytes(b"partial")
    (root / "step-00000001" / ".manifest.json.fastpersist-tmp-1234").write_bytes(b"{")
    ck.close()
    reader = Checkpointer(str(root))  # readers never clean: a writer may be at work
    assert [(i.step, i.committed) for i in reader.list()] == [(1, True), (2, False)]
    writer = Checkpointer(str(root))
    writer.save(3, {"x": torch.ones(3)}).wait()  # the first save takes the root, then cleans
    assert sorted(os.listdir(root)) == [".fastpersist.lock", "latest", "step-00000001", "step-00000003"]
    assert ".manifest.json.fastpersist-tmp-1234" not in os.listdir(root / "step-00000001")


def test_saves_from_a_thread_while_training_thread_runs(tmp_path):
    """The background worker and the training thread do not share a lock that stalls either:
    while a checkpoint is in flight (its writes held), the training thread makes progress."""
    backend = HeldBackend(hold="step-00000000")
    ck = Checkpointer(str(tmp_path / "ck"), mode="snapshot", max_in_flight=2, backend=backend)
    stop = threading.Event()
    counter = [0]

    def spin() -> None:
        while not stop.is_set():
            counter[0] += 1

    t, errors = _thread(spin)
    first = ck.save(0, {"w": torch.randn(200_000)})
    assert backend.holding.wait(30)
    before = counter[0]
    wait_until(lambda: counter[0] > before)  # training runs while the save is in flight
    assert not first.done()
    backend.release()
    for s in range(1, 5):
        ck.save(s, {"w": torch.randn(200_000)})
    ck.close()
    stop.set()
    t.join(30)
    assert errors == [] and [i.step for i in ck.list()] == [0, 1, 2, 3, 4]


def _losses(lines: list[str]) -> dict[int, str]:
    return {int(p[1]): p[3] for p in (line.split() for line in lines) if len(p) == 4 and p[0] == "step"}


def _train(directory: str, *args: str) -> list[str]:
    out = subprocess.run([sys.executable, os.path.join(HERE, "train_child.py"), directory, *args],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout.splitlines()


def test_sigkill_during_a_write_resumes_exactly(tmp_path):
    """A training run killed with SIGKILL while a checkpoint is being written resumes from the
    latest committed checkpoint and produces the same losses as an uninterrupted run. The kill
    lands mid-write every time: the child holds the second data write of step 6's checkpoint,
    says so, and the parent kills it then."""
    steps, held = 14, 6
    reference = _losses(_train(str(tmp_path / "ref"), str(steps), "none"))
    assert sorted(reference) == list(range(steps))
    run = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "train_child.py"), run, str(steps), "overlap",
                             str(held)], stdout=subprocess.PIPE, text=True)
    killed_lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.strip() == "holding":
            proc.send_signal(signal.SIGKILL)
            break
        killed_lines.append(line)
    proc.stdout.close()
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    killed = _losses(killed_lines)
    assert sorted(killed) == list(range(held + 1)) and all(killed[s] == reference[s] for s in killed)
    infos = {i.step: i.committed for i in list_checkpoints(os.path.join(run, "r0"))}
    assert infos[held] is False and max(s for s, c in infos.items() if c) == held - 1  # killed mid-write
    lines = _train(run, str(steps), "overlap")
    assert lines[0] == f"resumed from step {held - 1}"
    resumed = _losses(lines)
    assert sorted(resumed) == list(range(held, steps))
    assert all(resumed[s] == reference[s] for s in resumed)  # bit for bit


def test_checkpoint_in_flight_at_exit_is_finished(tmp_path):
    """A job that ends right after save(), without close(), still gets its last checkpoint
    (its writes are held until the interpreter exits: the save is in flight at exit)."""
    root = str(tmp_path / "ck")
    code = (f"import sys, torch; sys.path.insert(0, {HERE!r}); "
            "from helpers import HeldBackend, release_at_exit; from fastpersist.checkpointer import Checkpointer; "
            f"b = HeldBackend('step-'); c = Checkpointer({root!r}, backend=b); "
            "release_at_exit(b.release); "  # the writes wait until the interpreter exits
            "h = c.save(1, {'x': torch.ones(10)}); assert not h.done()")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    assert Checkpointer(root).latest_step() == 1
