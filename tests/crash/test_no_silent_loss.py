"""No silent loss, by construction: one save driver, distinct roots, rollback timelines, the
replicated-state check, side-effect-free reading, and an API that does not surprise.

Each test names the failure it guards against; each failed on the code before these guarantees.
"""

from __future__ import annotations

import errno
import logging
import os
import random
import subprocess
import sys
import threading

import pytest
import torch
from helpers import SUPPORT, HeldBackend, assert_state_equal, file_names, replicated, run_ranks, states_equal, wait_until

import fastpersist as fp
from fastpersist.storage.faults import Fault, FaultyBackend

SMALL = 200_000  # bytes of a state that fits the snapshot budget below
BIG = 2_000_000  # ... and of one that does not
BUDGET = 1 << 20


# ---------------------------------------------------------------------------------------------
# 1. one save driver


def test_over_budget_save_waits_for_queued_ones(tmp_path):
    """An over-budget save of step 2 used to run inline and commit while step 1 was still
    queued; step 1 then committed and `latest` moved back to step 1."""
    backend = HeldBackend(hold="step-00000001")
    ck = fp.Checkpointer(str(tmp_path / "ck"), max_in_flight=2, snapshot_bytes=BUDGET, backend=backend)
    h1 = ck.save(1, replicated(1, SMALL))
    assert backend.holding.wait(30)
    releaser = threading.Thread(target=lambda: (wait_until(lambda: len(ck.in_flight) == 2), backend.release()))
    releaser.start()
    h2 = ck.save(2, replicated(2, BIG))  # over budget: returns once committed
    releaser.join()
    assert h1.done() and h2.done() and h2.metrics.inline
    assert ck.latest_step() == 2
    assert_state_equal(ck.load(), replicated(2, BIG))
    assert_state_equal(ck.load(1), replicated(1, SMALL))
    ck.close()


def _driver_trials(rank: int, world: int, root: str, seed: int) -> list[str]:
    """Every mode x max_in_flight 1..3, random in/over-budget saves; after each save() the
    newest acknowledged step is never newer than `latest`, and every step loads exactly."""
    rng = random.Random(seed)
    log = []
    for mode in ("sync", "snapshot", "overlap"):
        for in_flight in (1, 2, 3):
            sub = os.path.join(root, f"{mode}-{in_flight}")
            ck = fp.Checkpointer(sub, mode=mode, max_in_flight=in_flight, snapshot_bytes=BUDGET)
            handles, sizes = [], {}
            for step in range(1, 7):
                size = rng.choice((SMALL, BIG))
                sizes[step] = size
                handles.append(ck.save(step, replicated(step, size)))
                acked = [h.step for h in handles if h.done() and h.exception() is None]
                latest = ck.latest_step()
                if acked and (latest is None or latest < max(acked)):
                    raise AssertionError(f"{mode}/{in_flight}: latest {latest} is older than acknowledged {max(acked)}")
            ck.close()
            if ck.latest_step() != 6:
                raise AssertionError(f"{mode}/{in_flight}: latest is {ck.latest_step()} after the last save")
            for step, size in sizes.items():
                if not states_equal(ck.load(step), replicated(step, size)):
                    raise AssertionError(f"{mode}/{in_flight}: step {step} does not load exactly")
            log.append(f"{mode}/{in_flight}: {[sizes[s] == BIG for s in sorted(sizes)]}")
    return log


def test_one_driver_orders_commits_single_rank(tmp_path):
    _driver_trials(0, 1, str(tmp_path / "ck"), seed=1)


def test_one_driver_orders_commits_three_ranks(tmp_path):
    run_ranks(tmp_path, 3, _driver_trials, str(tmp_path / "ck"), 2)


# ---------------------------------------------------------------------------------------------
# 2. roots must be distinct


def test_same_root_twice_is_refused(tmp_path):
    """`Checkpointer([r, r])` committed, then its cleanup deleted every data file."""
    r = str(tmp_path / "r")
    with pytest.raises(ValueError, match=r"roots\[0\] .* and roots\[1\] .* are the same directory"):
        fp.Checkpointer([r, r])
    with pytest.raises(ValueError, match="same directory"):
        fp.Checkpointer([r, r + "/"])
    assert not os.path.exists(r)  # construction creates nothing


def test_symlink_and_bind_mount_to_a_root_are_refused(tmp_path):
    r = tmp_path / "r"
    r.mkdir()
    (tmp_path / "link").symlink_to(r)
    with pytest.raises(ValueError, match="same directory"):
        fp.Checkpointer([str(r), str(tmp_path / "link")])
    bind = tmp_path / "bind"
    bind.mkdir()
    if subprocess.run(["mount", "--bind", str(r), str(bind)], capture_output=True).returncode != 0:
        pytest.skip("bind mounts need root")
    try:
        with pytest.raises(ValueError, match="same directory"):
            fp.Checkpointer([str(r), str(bind)])
    finally:
        subprocess.run(["umount", str(bind)], check=False)


def test_nested_roots_are_refused(tmp_path):
    with pytest.raises(ValueError, match="inside another root"):
        fp.Checkpointer([str(tmp_path / "a"), str(tmp_path / "a" / "b")])


def test_unusable_roots_fail_at_construction(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(fp.CheckpointWriteError, match=f"{f} is a file"):
        fp.Checkpointer(str(f))
    with pytest.raises(fp.CheckpointWriteError, match=f"cannot be created: {f} is not a directory"):
        fp.Checkpointer(str(f / "sub"))


# ---------------------------------------------------------------------------------------------
# 3. rollback timelines


def _timeline(rank: int, world: int, root: str, abandoned: str) -> dict:
    ck = fp.Checkpointer(root, mode="sync", keep=2, keep_every=5, abandoned=abandoned)
    for step in (5, 8, 9, 10):
        ck.save(step, replicated(step, SMALL))
    resumed = ck.load(5)
    if resumed["step"] != 5:
        raise AssertionError("did not resume from 5")
    for step in (6, 7):
        ck.save(step, replicated(step + 100, SMALL))
    ck.close()
    infos = {i.step: (i.committed, i.latest, i.abandoned) for i in ck.list()}
    return {"infos": infos, "latest": ck.latest_step()}


@pytest.mark.parametrize("world", [1, 3])
def test_resume_from_an_older_step_starts_a_new_timeline(tmp_path, world, caplog):
    """Saving 8, 9, 10, resuming from 5 and saving 6, 7 with keep=2 used to keep 7, 9, 10 and
    delete 5 and 6; once `latest` was gone, latest_step() named 10, of the abandoned run."""
    root = str(tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        if world == 1:
            got = _timeline(0, 1, root, "keep")
        else:
            got = run_ranks(tmp_path, world, _timeline, root, "keep")[0]
    # live timeline 5, 6, 7 (5 is a multiple of keep_every); 9, 10 abandoned and kept; 8 was
    # deleted by retention before the rollback
    assert got["infos"] == {5: (True, False, False), 6: (True, False, False), 7: (True, True, False),
                            9: (True, False, True), 10: (True, False, True)}
    assert got["latest"] == 7
    if world == 1:
        assert any("starts a new timeline" in r.message and "9, 10" in r.message for r in caplog.records)
    os.unlink(os.path.join(root, "latest"))
    view = fp.open(root)
    assert view.latest_step() == 7  # the most recent commit, not the largest step
    assert_state_equal(view.load(), replicated(107, SMALL))
    assert_state_equal(view.load(10), replicated(10, SMALL))


def test_abandoned_delete_policy(tmp_path):
    got = _timeline(0, 1, str(tmp_path / "ck"), "delete")
    assert sorted(got["infos"]) == [5, 6, 7] and got["latest"] == 7


_CRASH_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import replicated
import fastpersist as fp
from fastpersist.storage.faults import Fault, FaultyBackend
root = {root!r}
ck = fp.Checkpointer(root, mode="sync")
for step in (5, 8, 9, 10):
    ck.save(step, replicated(step, {small}))
ck.close()
ck = fp.Checkpointer(root, mode="sync", backend=FaultyBackend([Fault("event", None, point="after-data", kill=True)]))
ck.save(6, replicated(106, {small}))
"""


def test_crash_before_the_new_timeline_commits(tmp_path):
    root = str(tmp_path / "ck")
    code = _CRASH_CHILD.format(tests=SUPPORT, root=root, small=SMALL)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    view = fp.open(root)
    assert view.latest_step() == 10  # nothing of the new timeline committed: the old one stands
    assert {i.step: i.committed for i in view.list()} == {5: True, 6: False, 8: True, 9: True, 10: True}
    ck = fp.Checkpointer(root, mode="sync")
    ck.save(6, replicated(106, SMALL))
    ck.close()
    infos = {i.step: i.abandoned for i in ck.list()}
    assert infos == {5: False, 6: False, 8: True, 9: True, 10: True} and ck.latest_step() == 6
    assert_state_equal(ck.load(), replicated(106, SMALL))


# ---------------------------------------------------------------------------------------------
# 4. replicated state must be replicated


def _diverged(rank: int, world: int, root: str, check: bool) -> str:
    ck = fp.Checkpointer(root, mode="sync", check_replicated=check)
    ck.save(1, replicated(1, SMALL))
    state = replicated(2, SMALL)
    if rank == 1:
        state["model"]["w"][123] += 1.0  # same shapes, one value differs
    try:
        ck.save(2, state)
    except fp.ReplicaMismatchError as e:
        return f"raised: {e} | key={e.key} ranks={e.ranks}"
    finally:
        ck.close()
    return "committed"


def test_diverged_replicated_state_is_refused_on_every_rank(tmp_path):
    """Two ranks passing same-shaped tensors with different values used to commit a checkpoint
    mixing both (the error text even claimed values were compared)."""
    root = str(tmp_path / "ck")
    results = run_ranks(tmp_path, 3, _diverged, root, True)
    for r in results:
        assert r.startswith("raised:") and "key=state['model.w']" in r and "ranks=[1]" in r, r
        assert "rank_state" in r and "check_replicated=False" in r
    view = fp.open(root)
    assert view.latest_step() == 1 and [i.step for i in view.list() if i.committed] == [1]
    assert file_names([os.path.join(root, "step-00000002")]) == [] or not os.path.exists(
        os.path.join(root, "step-00000002"))


def test_replica_check_can_be_turned_off(tmp_path):
    results = run_ranks(tmp_path, 2, _diverged, str(tmp_path / "ck"), False)
    assert results == ["committed", "committed"]


# ---------------------------------------------------------------------------------------------
# 5. reading has no side effects


def test_reading_creates_nothing(tmp_path):
    """`Checkpointer("/typo/run1").load()` used to create /typo/run1."""
    missing = tmp_path / "typo" / "run1"
    with pytest.raises(fp.CheckpointNotFoundError, match="no committed checkpoint"):
        fp.Checkpointer(str(missing)).load()
    assert not (tmp_path / "typo").exists()
    view = fp.open(str(missing))
    assert view.list() == [] and view.latest_step() is None
    with pytest.raises(fp.CheckpointNotFoundError):
        view.load()
    assert not (tmp_path / "typo").exists()


def test_view_reads_a_checkpoint_without_lock_or_group(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    with fp.Checkpointer(roots, mode="sync") as ck:
        ck.save(3, replicated(3, SMALL), rank_state={"r": torch.arange(5)}, metadata={"loss": 1.5})
    before = file_names(roots)
    view = fp.open(roots)
    assert_state_equal(view.load(3), replicated(3, SMALL))
    assert_state_equal(view.load_rank_state(3, rank=0), {"r": torch.arange(5)})
    assert view.metadata(3) == {"loss": 1.5} and view.verify(3) == []
    assert file_names(roots) == before
    assert os.path.getsize(os.path.join(roots[0], ".fastpersist.lock")) == 0  # released, not re-taken


# ---------------------------------------------------------------------------------------------
# 7. API and errors that do not surprise


def test_wrong_arguments_raise_value_and_type_errors(tmp_path):
    root = str(tmp_path / "ck")
    for kwargs, kind, word in [({"mode": "fast"}, ValueError, "mode"), ({"keep": 0}, ValueError, "keep"),
                               ({"keep_every": -1}, ValueError, "keep_every"),
                               ({"max_in_flight": 0}, ValueError, "max_in_flight"),
                               ({"when_busy": "drop"}, ValueError, "when_busy"),
                               ({"abandoned": "trash"}, ValueError, "abandoned"),
                               ({"max_in_flight": 1.5}, TypeError, "max_in_flight")]:
        with pytest.raises(kind, match=word):
            fp.Checkpointer(root, **kwargs)
    ck = fp.Checkpointer(root)
    with pytest.raises(TypeError, match="step"):
        ck.save("1", {})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="step"):
        ck.save(-1, {})
    with pytest.raises(TypeError, match="step"):
        ck.load(1.0)  # type: ignore[arg-type]
    ck.close()


def test_metadata_is_validated_before_writing_and_readable(tmp_path):
    """A non-JSON metadata value used to fail at commit, after all data was written."""
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync")
    with pytest.raises(TypeError, match="'bad'"):
        ck.save(1, replicated(1, SMALL), metadata={"ok": 1, "bad": torch.zeros(1)})
    with pytest.raises(TypeError, match="'nan'"):
        ck.save(1, replicated(1, SMALL), metadata={"nan": float("nan")})
    assert not os.path.exists(tmp_path / "ck" / "step-00000001")
    ck.save(1, replicated(1, SMALL), metadata={"loss": 0.25, "tags": ["a"]})
    assert ck.metadata(1) == {"loss": 0.25, "tags": ["a"]} and ck.metadata() == ck.metadata(1)
    ck.close()


def test_load_rank_state_takes_loads_argument_order(tmp_path):
    """`load_rank_state(1, {"rng": rng})` used to fail with an unrelated TypeError."""
    rng = fp.RNGState()
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync")
    torch.manual_seed(7)
    ck.save(1, {"x": torch.ones(3)}, rank_state={"rng": rng})
    expected = torch.rand(4)
    ck.load_rank_state(1, {"rng": rng})
    assert torch.equal(torch.rand(4), expected)
    ck.close()


def test_load_failures_are_checkpoint_errors(tmp_path):
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync")
    ck.save(1, {"x": torch.ones(3)})
    with pytest.raises(fp.CheckpointReadError, match="step-00000001"):
        ck.load(1, map_location="cuda:0" if not torch.cuda.is_available() else "nosuchdevice")
    ck.close()


def test_history_is_bounded_with_totals(tmp_path):
    ck = fp.Checkpointer(str(tmp_path / "ck"), history=3, keep=1)
    for step in range(8):
        ck.save(step, {"x": torch.full((10,), float(step))})
    ck.close()
    assert [m.step for m in ck.history] == [5, 6, 7]
    assert ck.history.saves == 8 and ck.history.bytes_total == 8 * 40


def test_a_failure_is_raised_not_also_logged(tmp_path, caplog):
    backend = FaultyBackend([Fault("write", errno.EIO, at=1)])
    ck = fp.Checkpointer(str(tmp_path / "ck"), backend=backend)
    with caplog.at_level(logging.DEBUG, logger="fastpersist"):
        h = ck.save(1, {"x": torch.ones(100_000)})
        with pytest.raises(fp.CheckpointWriteError, match="injected write fault") as info:
            h.wait()
    assert "--- rank" not in str(info.value)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    ck.close()


def test_save_after_close_raises(tmp_path):
    ck = fp.Checkpointer(str(tmp_path / "ck"))
    ck.close()
    with pytest.raises(fp.CheckpointerClosedError, match="after close"):
        ck.save(1, {})


def test_handle_is_a_future(tmp_path):
    ck = fp.Checkpointer(str(tmp_path / "ck"))
    seen = []
    h = ck.save(1, {"x": torch.ones(10)})
    h.add_done_callback(lambda handle: seen.append(handle.step))
    assert h.result(timeout=30).step == 1 and h.staged.done() and h.exception() is None
    ck.close()
    assert seen == [1]


def test_errors_live_in_one_module():
    """The package exports exactly the exceptions fastpersist.errors defines (every one, and no
    other module's), all of them under CheckpointError: one hierarchy to catch."""
    import inspect

    from fastpersist import errors

    def is_error(obj: object) -> bool:
        return inspect.isclass(obj) and issubclass(obj, BaseException)

    exported = {name: getattr(fp, name) for name in fp.__all__ if is_error(getattr(fp, name))}
    defined = {name: c for name, c in vars(errors).items() if is_error(c) and c.__module__ == errors.__name__}
    assert exported == defined
    assert all(issubclass(c, fp.CheckpointError) for c in defined.values())


# ---------------------------------------------------------------------------------------------
# 8. faults reach retention and cleanup


def test_failed_deletion_in_retention_is_logged_and_loses_nothing(tmp_path, caplog):
    backend = FaultyBackend([Fault("delete", errno.EIO, at=0, path_contains="step-00000001")])
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", keep=1, backend=backend)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        ck.save(1, replicated(1, SMALL))
        ck.save(2, replicated(2, SMALL))  # retention tries to delete 1 and fails
        ck.wait()  # retention deletes in its own thread; wait() waits for it
    assert any("could not delete checkpoint step 1" in r.message for r in caplog.records)
    assert_state_equal(ck.load(1), replicated(1, SMALL))
    assert_state_equal(ck.load(2), replicated(2, SMALL))
    backend.arm([])
    ck.save(3, replicated(3, SMALL))  # the next retention pass deletes what it could not before
    assert [i.step for i in ck.list()] == [3]
    ck.close()


def test_failed_listing_in_cleanup_does_not_stop_the_save(tmp_path, caplog):
    root = tmp_path / "ck"
    (root / "step-00000009").mkdir(parents=True)  # a crashed save's leftover
    backend = FaultyBackend([Fault("list", errno.EIO, at=0)])
    ck = fp.Checkpointer(str(root), mode="sync", backend=backend)
    ck.save(1, replicated(1, SMALL))
    assert ck.latest_step() == 1
    ck.close()


def test_lock_goes_through_the_backend(tmp_path):
    backend = FaultyBackend([Fault("lock", errno.EACCES)])
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", backend=backend)
    with pytest.raises(fp.CheckpointWriteError, match="cannot lock"):
        ck.save(1, {"x": torch.ones(3)})
    assert backend.fired == [("lock", str(tmp_path / "ck" / ".fastpersist.lock"))]
    backend.arm([])
    ck.save(1, {"x": torch.ones(3)})
    ck.close()
    assert [i.step for i in ck.list()] == [1]


def test_single_file_directory_fsync_failure_is_reported(tmp_path):
    """A failure after the rename says the new file is in place (not "previous file kept")."""
    path = tmp_path / "model.pt"
    backend = FaultyBackend([Fault("fsync", errno.EIO, at=2)])  # 1: the file, 2: its directory
    with pytest.raises(fp.CheckpointWriteError, match="replaced by the new, complete file"):
        fp.save(replicated(2, SMALL), path, backend=backend)
    assert_state_equal(fp.load(path), replicated(2, SMALL))


@pytest.mark.parametrize("op", ["open", "write", "fsync", "rename"])
def test_single_file_save_fault_keeps_the_previous_file(tmp_path, op):
    """Every step of fastpersist.save goes through the file seam: a fault at any of them leaves
    the previous file intact and no temporary file behind."""
    path = tmp_path / "model.pt"
    fp.save(replicated(1, SMALL), path)
    backend = FaultyBackend([Fault(op, errno.ENOSPC if op in ("write", "open") else errno.EIO)])
    with pytest.raises(fp.CheckpointWriteError, match="model.pt"):
        fp.save(replicated(2, SMALL), path, backend=backend)
    assert backend.fired and os.listdir(tmp_path) == ["model.pt"]
    assert_state_equal(fp.load(path), replicated(1, SMALL))


def _one_rank_raises(rank: int, world: int, root: str) -> list[str]:
    """Rank 1's save(1) raises (a bad argument on that rank only); both ranks go on saving."""
    ck = fp.Checkpointer(root, mode="sync", timeout_s=60)
    outcomes = []
    for step in (1, 2, 3):
        meta = {"loss": float("nan")} if (rank == 1 and step == 1) else {"loss": 1.0}
        try:
            ck.save(step, replicated(step, SMALL), metadata=meta)
            outcomes.append(f"{step}:ok")
        except TypeError:
            outcomes.append(f"{step}:bad-argument")
        except fp.CheckpointWriteError as e:
            outcomes.append(f"{step}:{'out-of-step' if 'out of step' in str(e) else str(e)[:80]}")
    ck.close()
    return outcomes


def test_a_save_raising_on_one_rank_cannot_commit_mismatched_data(tmp_path):
    """One rank's save() raising before queueing used to shift its queue against the others':
    later saves were acknowledged on both ranks, `latest` moved, and nothing could be loaded."""
    root = str(tmp_path / "ck")
    r0, r1 = run_ranks(tmp_path, 2, _one_rank_raises, root, timeout=240)
    assert r1[0] == "1:bad-argument"
    assert all(o.endswith("out-of-step") for o in r0 + r1[1:]), (r0, r1)
    view = fp.open(root)
    assert view.latest_step() is None and [i.step for i in view.list() if i.committed] == []


_EXIT_CHILD = """
import sys
sys.path.insert(0, {tests!r})
from helpers import HeldBackend, release_at_exit, replicated
import fastpersist as fp
backend = HeldBackend("step-")
ck = fp.Checkpointer({roots!r}, backend=backend)
release_at_exit(backend.release)  # the writes wait until the interpreter exits
h = ck.save(1, replicated(1, {small}))
assert not h.done()
# no close(): the interpreter exits with the checkpoint in flight
"""


def test_checkpoint_in_flight_at_exit_is_finished_over_two_roots(tmp_path):
    """With two roots the writes use a thread pool, which concurrent.futures shuts down at
    exit: the exit hook must run before that, or the last checkpoint is lost. (The child's
    writes are held until it exits, so its checkpoint is in flight then, every run.)"""
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    code = _EXIT_CHILD.format(tests=SUPPORT, roots=roots, small=SMALL)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "failed" not in proc.stderr, proc.stderr
    assert_state_equal(fp.open(roots).load(1), replicated(1, SMALL))


def test_failed_directory_removal_in_retention_does_not_fail_the_save(tmp_path, caplog):
    # call 1 removes step 1's manifest (it stops being a checkpoint), call 2 its directory: fails
    backend = FaultyBackend([Fault("delete", errno.EIO, at=2, path_contains="step-00000001")])
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", keep=1, backend=backend)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        ck.save(1, replicated(1, SMALL))
        ck.save(2, replicated(2, SMALL))  # committed: the cleanup failure is only logged
        ck.wait()  # retention deletes in the background: wait() waits for it
    assert any("could not remove" in r.message for r in caplog.records)
    assert ck.latest_step() == 2 and [i.step for i in ck.list() if i.committed] == [2]
    assert_state_equal(ck.load(), replicated(2, SMALL))
    ck.close()


def test_metadata_keys_and_rank_types(tmp_path):
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync")
    with pytest.raises(TypeError, match="keys must be strings"):
        ck.save(1, {"x": torch.ones(1)}, metadata={1: "a"})
    ck.save(1, {"x": torch.ones(1)}, rank_state={"r": 1})
    with pytest.raises(TypeError, match="rank"):
        fp.open(ck.roots).load_rank_state(1, rank="0")  # type: ignore[arg-type]
    ck.close()


def test_resaving_the_latest_step_abandons_nothing(tmp_path, caplog):
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync")
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        ck.save(1, {"x": torch.ones(1)})
        ck.save(1, {"x": torch.zeros(1)})
    assert not [r for r in caplog.records if "timeline" in r.message]
    assert [i.abandoned for i in ck.list()] == [False]
    ck.close()


def test_torch_internals_are_checked(monkeypatch):
    """torch's private serialization calls live in one module, which names what differs."""
    from fastpersist import torch_internals

    torch_internals.check.cache_clear()
    torch_internals.check()  # the installed torch is a tested one
    monkeypatch.delattr(torch.serialization, "_get_storage_alignment")
    torch_internals.check.cache_clear()
    try:
        with pytest.raises(fp.UnsupportedTorchError, match="_get_storage_alignment is missing"):
            torch_internals.storage_alignment()
    finally:
        monkeypatch.undo()
        torch_internals.check.cache_clear()


def test_eio_on_read_names_the_file_and_storage(tmp_path):
    """Loads go through the file seam too: an I/O error in a data read names the file, the
    storage and the step; the checkpoint is fine once the fault is gone."""
    backend = FaultyBackend()
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", backend=backend)
    ck.save(1, replicated(1, SMALL))
    backend.arm([Fault("read", errno.EIO, at=2, path_contains="replicated-0000.bin")])  # 1: the open
    with pytest.raises(fp.CheckpointReadError, match=r"replicated-0000\.bin.*Input/output error.*storage.*step 1"):
        ck.load(1)
    backend.arm([])
    assert_state_equal(ck.load(1), replicated(1, SMALL))
    ck.close()


def test_single_file_load_reads_through_the_seam(tmp_path):
    path = tmp_path / "m.pt"
    fp.save(replicated(1, SMALL), path)
    backend = FaultyBackend([Fault("read", errno.EIO, at=1)])
    with pytest.raises(fp.CheckpointReadError, match="m.pt"):
        fp.load(path, backend=backend)
    assert backend.fired and backend.fired[0][0] == "read"


def test_ls_shows_abandoned_checkpoints(tmp_path, capsys):
    from fastpersist.cli import main

    root = str(tmp_path / "ck")
    _timeline(0, 1, root, "keep")
    assert main(["ls", root]) == 0
    rows = {int(line.split()[0]): line.split()[1] for line in capsys.readouterr().out.splitlines()[1:]}
    assert rows == {5: "committed", 6: "committed", 7: "latest", 9: "abandoned", 10: "abandoned"}
