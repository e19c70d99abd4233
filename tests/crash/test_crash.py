"""The crash matrix: a real saving process killed with SIGKILL at every point of the save
protocol, in the middle of a save's data writes, and at random instants. Afterwards: every
committed checkpoint loads bit-exactly, nothing partial is listed or loadable, and the next
writer cleans what was left.

The kills at protocol points and mid-save land where they are meant to every time (the child
kills itself there, or holds a write and tells the parent, which kills it then). The default
run also covers a few random instants; `pytest -m long` runs the long mode (100+ random
instants over the three modes)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from helpers import SUPPORT
from helpers import states_equal as _equal

import fastpersist as fp
from fastpersist.storage.catalog import TEMP_SUFFIX
from fastpersist.checkpointer import Checkpointer, list_checkpoints
from fastpersist.storage.backend import PROTOCOL_POINTS

from crash_child import state  # noqa: E402

CHILD = os.path.join(SUPPORT, "crash_child.py")


def _run_child(roots: list[str], mode: str, point: str, at: int, delay: float,
               kill_after: float | None = None) -> list[int]:
    """Run the child until it dies: by its own fault, killed when it says it is holding a write
    ("mid-save"), or killed after ``kill_after`` s (a random instant)."""
    proc = subprocess.Popen([sys.executable, CHILD, ",".join(roots), mode, point, str(at), str(delay)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    committed: list[int] = []
    assert proc.stdout.readline().strip() == "ready"
    if kill_after is not None:
        deadline = time.monotonic() + kill_after
        os.set_blocking(proc.stdout.fileno(), False)
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
        os.set_blocking(proc.stdout.fileno(), True)
    for line in proc.stdout:
        if line.strip() == "holding":  # a save's data write is held: kill it there
            proc.send_signal(signal.SIGKILL)
            continue
        committed.append(int(line.split()[1]))
    proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return committed


def _check_after_crash(roots: list[str], acknowledged: list[int]) -> dict:
    """Every invariant the crash must not break; returns a summary."""
    infos = list_checkpoints(roots[0])
    committed = [i.step for i in infos if i.committed]
    partial = [i.step for i in infos if not i.committed]
    if acknowledged:
        assert committed and max(committed) >= acknowledged[-1]  # nothing acknowledged was lost
    reader = Checkpointer(roots)
    latest = reader.latest_step()  # `latest` names a committed checkpoint, at least the last acknowledged
    assert latest in committed if committed else latest is None
    if acknowledged:
        assert latest >= acknowledged[-1]
    for step in committed:  # every committed checkpoint loads, bit for bit
        assert _equal(reader.load(step), state(step))
    for step in partial:  # a partial one is never loadable
        with pytest.raises(fp.CheckpointNotFoundError):
            reader.load(step)
    # the next writer cleans the leftovers, and saves
    nxt = max(committed, default=0) + 1
    with Checkpointer(roots, keep=3) as writer:
        writer.save(nxt, state(nxt)).wait()
    for root in roots:
        for name in os.listdir(root):
            assert TEMP_SUFFIX not in name, name
            path = os.path.join(root, name)
            if os.path.isdir(path):
                assert not any(TEMP_SUFFIX in n for n in os.listdir(path))
    after = list_checkpoints(roots[0])
    assert all(i.committed for i in after) and after[-1].step == nxt
    assert _equal(Checkpointer(roots).load(), state(nxt))
    return {"committed": committed, "partial": partial}


@pytest.mark.parametrize("point", PROTOCOL_POINTS)
def test_kill_at_each_protocol_point(tmp_path, point):
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    acknowledged = _run_child(roots, "snapshot", point, at=3, delay=0.0)
    latest_before = Checkpointer(roots).latest_step()
    summary = _check_after_crash(roots, acknowledged)
    if point in ("after-data", "after-manifest-temp"):  # killed before the commit point
        assert summary["committed"][-1] == 2 and 3 in summary["partial"] and latest_before == 2
    else:  # killed after it: step 3 is committed even though the save never returned
        assert summary["committed"][-1] == 3
        # the pointer moves last, but "latest" is the most recent commit even when its update was lost
        assert latest_before == 3


@pytest.mark.parametrize("mode", ["sync", "overlap"])
def test_kill_before_commit_in_other_modes(tmp_path, mode):
    roots = [str(tmp_path / "r0")]
    acknowledged = _run_child(roots, mode, "after-manifest-temp", at=2, delay=0.0)
    summary = _check_after_crash(roots, acknowledged)
    assert summary["committed"] == [1]


@pytest.mark.parametrize("point", PROTOCOL_POINTS)
def test_kill_incremental_save_at_each_protocol_point(tmp_path, point):
    """Incremental saves (the frozen tensor's files are linked from the last checkpoint, and
    retention deletes the older ones): a kill anywhere loses nothing committed."""
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    acknowledged = _run_child(roots, "snapshot+inc", point, at=4, delay=0.0)
    summary = _check_after_crash(roots, acknowledged)
    assert summary["committed"][-1] == (3 if point in ("after-data", "after-manifest-temp") else 4)
    assert any(os.stat(os.path.join(r, "step-00000003", n)).st_nlink > 1
               for r in roots for n in os.listdir(os.path.join(r, "step-00000003")) if n.endswith(".bin"))


@pytest.mark.parametrize("mode", ["sync", "snapshot", "overlap", "snapshot+inc", "overlap+inc"])
def test_kill_mid_save(tmp_path, mode):
    """Killed while step 3's data is being written (its second data write is held, and the
    child is killed there): step 3 is partial, step 2 is the latest, the next writer cleans."""
    roots = [str(tmp_path / "r0"), str(tmp_path / "r1")]
    acknowledged = _run_child(roots, mode, "mid-save", at=3, delay=0.0)
    step3 = [os.path.join(r, "step-00000003") for r in roots]
    assert any(n.endswith(".bin") for d in step3 for n in os.listdir(d))  # its data files were open
    assert not any(os.path.exists(os.path.join(d, "manifest.json")) for d in step3)
    summary = _check_after_crash(roots, acknowledged)
    assert acknowledged == [1, 2] and summary["committed"] == [1, 2] and summary["partial"] == [3]


def _random_trials(tmp_path, count: int, seed: int) -> None:
    """Kills at random instants: wherever they land (in a save, between saves; the mid-save
    case is checked every run by test_kill_mid_save), nothing committed is lost or torn."""
    rng = random.Random(seed)
    outcomes = {"mid-save": 0, "between": 0}
    for trial in range(1, count + 1):
        roots = [str(tmp_path / f"t{trial}" / "r0"), str(tmp_path / f"t{trial}" / "r1")]
        mode = ["sync", "snapshot", "overlap", "snapshot+inc", "overlap+inc"][trial % 5]
        acknowledged = _run_child(roots, mode, "none", 0, delay=0.002, kill_after=rng.uniform(0.05, 1.5))
        summary = _check_after_crash(roots, acknowledged)
        outcomes["mid-save" if summary["partial"] else "between"] += 1
    print(f"\n{count} SIGKILL trials: {outcomes['mid-save']} hit a save in progress, "
          f"{outcomes['between']} fell between saves; every committed checkpoint loaded bit-exactly")


def test_kill_at_random_instants(tmp_path):
    _random_trials(tmp_path, 3, seed=1)


@pytest.mark.long
def test_kill_at_random_instants_long(tmp_path):
    _random_trials(tmp_path, 102, seed=2)
