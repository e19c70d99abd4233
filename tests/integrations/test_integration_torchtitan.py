"""torchtitan through FastPersistCheckpointManager: torchtitan's CheckpointManager (its step
folders, interval, keep_latest_k, async mode, its own resume lookup) with fastpersist as DCP's
storage layer, on FSDP2 state over 2 gloo processes launched like torchrun; killed with SIGKILL
in the middle of writing a checkpoint, resumed exactly, and the same checkpoint resumed at 1
process with the same weights."""

from __future__ import annotations

import os
import shutil

from integration_util import check_resumed, random_kill, read_losses, require, run_job

CHILD = "integration_torchtitan_child.py"
STEPS = 7
KILL = 4

require("torchtitan")


def test_fsdp2_async_kill_and_resume_is_exact_and_reshards(tmp_path) -> None:
    ref_dir, run_dir, one_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "one"
    for d in (ref_dir, run_dir, one_dir):
        d.mkdir()
    run_job(CHILD, [str(ref_dir), str(STEPS), "0", "async"], 2, str(tmp_path))
    (reference,) = read_losses(str(ref_dir))
    assert sorted(reference) == list(range(1, STEPS + 1))
    run_job(CHILD, [str(run_dir), str(STEPS), random_kill(KILL, 2), "async"], 2, str(tmp_path), killed=True)
    ckpt = run_dir / "ckpt"
    # killed mid-write: step-KILL has data files but no committed metadata, so torchtitan's own
    # lookup resumes from the step before it; every rank wrote its own share of that one
    assert not (ckpt / f"step-{KILL}" / ".metadata").exists()
    assert (ckpt / f"step-{KILL - 1}" / ".metadata").is_file()
    shares = [f for f in os.listdir(ckpt / f"step-{KILL - 1}") if f.endswith(".fpdcp")]
    assert sorted(f.split("_")[2] for f in shares) == ["0", "1"], shares
    saved = shutil.copytree(ckpt, tmp_path / "saved")
    run_job(CHILD, [str(run_dir), str(STEPS), "0", "async"], 2, str(tmp_path))
    killed, resumed = read_losses(str(run_dir))
    check_resumed(reference, killed, resumed, KILL, STEPS)
    # resharded: the same checkpoint at 1 process (its first loss is rank 0's batch on the same
    # weights as the 2-process run's)
    shutil.copytree(saved, one_dir / "ckpt")  # with the killed write's partial step-KILL
    run_job(CHILD, [str(one_dir), str(STEPS), "0", "async"], 1, str(tmp_path))
    (one,) = read_losses(str(one_dir))
    assert sorted(one) == list(range(KILL, STEPS + 1))
    assert one[KILL] == reference[KILL]
    # against an uninterrupted run: a 2-process job (the same schedule) that stops before the
    # kill's step, resumed at 1 process from its checkpoint, has every loss of the killed job's
    # resharded resume
    short_dir, one_ref_dir = tmp_path / "short", tmp_path / "one-ref"
    for d in (short_dir, one_ref_dir):
        d.mkdir()
    run_job(CHILD, [str(short_dir), str(STEPS), "0", "async", str(KILL - 1)], 2, str(tmp_path))
    shutil.copytree(short_dir / "ckpt", one_ref_dir / "ckpt")
    run_job(CHILD, [str(one_ref_dir), str(STEPS), "0", "async"], 1, str(tmp_path))
    (one_ref,) = read_losses(str(one_ref_dir))
    assert one == one_ref
