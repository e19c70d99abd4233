"""Lightning through fastpersist's CheckpointIO plugins: real Trainer runs in child processes,
killed with SIGKILL in the middle of writing a checkpoint, resumed, and compared loss by loss
with an uninterrupted run (ddp over gloo with 2 processes; one process under -m long)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import fastpersist as fp
from fastpersist.storage import catalog
from integration_util import check_resumed, random_kill, read_losses, require, run_child, run_job

CHILD = "integration_lightning_child.py"
STEPS = 8
KILL = 4  # the checkpoint of global step 4 is being written when the process dies

require("lightning")


def _run(d: str, args: list[str], devices: int, killed: bool = False) -> None:
    """The child on ``devices`` processes: launched like torchrun when several (so one rank
    killed ends the job), else on its own."""
    if devices > 1:
        run_job(CHILD, [d, *args], devices, d, killed=killed)
    else:
        run_child(CHILD, [d, *args], killed=killed)


def _reference(d: str, devices: int) -> dict[int, str]:
    """An uninterrupted run, checkpointing through the single-file format."""
    _run(d, [str(STEPS), str(devices), "file", "0", "none"], devices)
    (losses,) = read_losses(d)
    assert sorted(losses) == list(range(STEPS))
    return losses


def _kill_and_resume(d: str, devices: int) -> tuple[dict[int, str], dict[int, str]]:
    ckpt = os.path.join(d, "ckpt")
    kill = random_kill(KILL, devices) if devices > 1 else str(KILL)  # one rank, at a random write request
    _run(d, [str(STEPS), str(devices), "async", kill, "none"], devices, killed=True)
    # Killed mid-write: the checkpoint of step KILL exists at most uncommitted in the staging root
    # (a rank killed at its first write may leave nothing), and the checkpoint Lightning resumes
    # from (last.ckpt) is the one before it.
    staged = [(c.step, c.committed) for c in fp.list_checkpoints(os.path.join(ckpt, ".fastpersist-staging"))]
    assert staged in ([], [(2 * (KILL - 1), False)]), (kill, staged)
    assert not os.path.exists(os.path.join(ckpt, f"step={KILL}.ckpt"))
    last = _committed(os.path.join(ckpt, "last.ckpt"))
    assert fp.load_checkpoint(last, rank=0, weights_only=False)["global_step"] == KILL - 1
    # Lightning's own ckpt_path="last" lookup: it must not pick the partial directory
    _run(d, [str(STEPS), str(devices), "async", "0", "last"], devices)
    killed, resumed = read_losses(d)
    return killed, resumed


def _committed(path: str) -> str:
    (info,) = [c for c in fp.list_checkpoints(path) if c.committed]
    return info.path


def _check_file_format(d: str) -> None:
    """Every kept single-file checkpoint is a file torch.load reads, equal to what
    fastpersist.load reads, and save_top_k removed the others."""
    ckpt = os.path.join(d, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["last.ckpt", f"step={STEPS - 1}.ckpt", f"step={STEPS}.ckpt"]
    plain = torch.load(os.path.join(ckpt, "last.ckpt"), weights_only=False)
    assert plain["global_step"] == STEPS
    fast = fp.load(os.path.join(ckpt, f"step={STEPS}.ckpt"), weights_only=False)
    assert fast.keys() == plain.keys() and fast["global_step"] == STEPS
    for k, v in plain["state_dict"].items():
        assert torch.equal(fast["state_dict"][k], v)
    for k, v in plain["optimizer_states"][0]["state"][0].items():
        assert torch.equal(fast["optimizer_states"][0]["state"][0][k], v)


def test_ddp_gloo_kill_and_resume_is_exact(tmp_path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    reference = _reference(str(ref_dir), 2)
    _check_file_format(str(ref_dir))
    killed, resumed = _kill_and_resume(str(run_dir), 2)
    check_resumed(reference, killed, resumed, KILL - 1, STEPS - 1)
    # save_top_k=2 with removal through the async plugin: two step checkpoints and last
    assert sorted(os.listdir(run_dir / "ckpt")) == ["last.ckpt", f"step={STEPS - 1}.ckpt", f"step={STEPS}.ckpt"]
    # FastPersistDDPStrategy: both ranks wrote a share of the model and optimizer state, in one
    # commit, and the rest of Lightning's dict is rank 0's
    step_dir = _committed(str(run_dir / "ckpt" / "last.ckpt"))
    shares = [f for f in os.listdir(step_dir) if "-replicated-" in f]
    assert len(shares) == 2 and all(os.path.getsize(os.path.join(step_dir, f)) > 0 for f in shares), shares
    loaded = fp.load_checkpoint(step_dir, weights_only=False)
    assert set(loaded) == {"state_dict", "optimizer_states"}
    assert fp.load_checkpoint(step_dir, rank=0, weights_only=False)["global_step"] == STEPS


@pytest.mark.long
def test_single_process_kill_and_resume_is_exact(tmp_path) -> None:
    ref_dir, run_dir = tmp_path / "ref", tmp_path / "run"
    ref_dir.mkdir(), run_dir.mkdir()
    reference = _reference(str(ref_dir), 1)
    _check_file_format(str(ref_dir))
    killed, resumed = _kill_and_resume(str(run_dir), 1)
    check_resumed(reference, killed, resumed, KILL - 1, STEPS - 1)


FSDP_CHILD = "integration_lightning_fsdp_child.py"
FSDP_STEPS = 6
FSDP_KILL = 3


def test_fsdp2_kill_and_resume_is_exact_and_reshards(tmp_path) -> None:
    """FastPersistModelParallelStrategy (FSDP2 over 2 gloo processes): every rank writes the
    chunks of the DTensors it owns; a SIGKILL mid-write resumes exactly at 2 processes, and the
    same checkpoint resumes at 1 process with the same weights (its first loss, on rank 0's
    batch, equals the uninterrupted 2-process run's), and every later loss equals (float.hex)
    those of a 1-process resume from an uninterrupted 2-process job's checkpoint of that step."""
    ref_dir, run_dir, one_dir = tmp_path / "ref", tmp_path / "run", tmp_path / "one"
    for d in (ref_dir, run_dir, one_dir):
        d.mkdir()
    run_job(FSDP_CHILD, [str(ref_dir), str(FSDP_STEPS), "2", "0", "none"], 2, str(tmp_path))
    (reference,) = read_losses(str(ref_dir))
    assert sorted(reference) == list(range(FSDP_STEPS))
    run_job(FSDP_CHILD, [str(run_dir), str(FSDP_STEPS), "2", random_kill(FSDP_KILL, 2), "none"], 2, str(tmp_path),
            killed=True)
    last = str(run_dir / "ckpt" / "last.ckpt")
    step_dir = _committed(last)
    assert fp.load_checkpoint(step_dir, rank=0, weights_only=False)["global_step"] == FSDP_KILL - 1
    manifest = catalog.read_manifest(step_dir)
    assert {t.key.split(".")[0] for t in manifest.sharded} == {"state_dict", "optimizer_0"}
    (weight,) = [t for t in manifest.sharded if t.key == "state_dict.net.0.weight"]
    assert len(weight.chunks) == 2  # each rank wrote the rows it owns
    saved = shutil.copytree(last, str(tmp_path / "saved.ckpt"))
    run_job(FSDP_CHILD, [str(run_dir), str(FSDP_STEPS), "2", "0", last], 2, str(tmp_path))
    killed, resumed = read_losses(str(run_dir))
    check_resumed(reference, killed, resumed, FSDP_KILL - 1, FSDP_STEPS - 1)
    run_child(FSDP_CHILD, [str(one_dir), str(FSDP_STEPS), "1", "0", str(saved)])
    (one,) = read_losses(str(one_dir))
    assert sorted(one) == list(range(FSDP_KILL - 1, FSDP_STEPS))
    assert one[FSDP_KILL - 1] == reference[FSDP_KILL - 1]
    # the resharded resume against an uninterrupted run: a 2-process job that stops at the kill's
    # step, resumed at 1 process from its last checkpoint, has every loss of the killed job's
    short_dir, one_ref_dir = tmp_path / "short", tmp_path / "one-ref"
    for d in (short_dir, one_ref_dir):
        d.mkdir()
    run_job(FSDP_CHILD, [str(short_dir), str(FSDP_KILL - 1), "2", "0", "none"], 2, str(tmp_path))
    run_child(FSDP_CHILD, [str(one_ref_dir), str(FSDP_STEPS), "1", "0", str(short_dir / "ckpt" / "last.ckpt")])
    (one_ref,) = read_losses(str(one_ref_dir))
    assert one == one_ref
