"""accelerate through AcceleratorCheckpointer: a real training loop (dropout, shuffled seedable
loader, scheduler, registered custom object) killed with SIGKILL in the middle of writing a
checkpoint, resumed, and compared loss by loss with an uninterrupted run; FSDP2 written by its
owners and resharded at load; FSDP1 and DeepSpeed refused."""

from __future__ import annotations

import os
import shutil
import types

import pytest
import torch

import fastpersist as fp
from helpers import assert_state_equal
from integration_util import (check_resumed, fsdp2_kill_resume_reshard, random_kill, read_losses, require, run_child,
                              run_job)

CHILD = "integration_accelerate_child.py"
STEPS = 8
KILL = 4

require("accelerate")


def test_kill_and_resume_is_exact(tmp_path) -> None:
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    run_dir.mkdir(), ref_dir.mkdir()
    run_child(CHILD, [str(run_dir), str(KILL)], killed=True)
    listed = {c.step: c.committed for c in fp.list_checkpoints(str(run_dir / "ckpt"))}
    assert listed[KILL] is False  # killed while writing step KILL
    assert {s for s, c in listed.items() if c} == {KILL - 2, KILL - 1}
    # retention deletes in the background (manifest first): a kill may land while it removes an
    # older step's files, which then stays, uncommitted, until the next start cleans it
    assert all(not c and s < KILL - 2 for s, c in listed.items() if s not in (KILL - 2, KILL - 1, KILL))
    run_child(CHILD, [str(run_dir), "0", str(ref_dir)])  # resume, then the uninterrupted run
    (reference,) = read_losses(str(ref_dir))
    killed, resumed = read_losses(str(run_dir))
    assert sorted(reference) == list(range(STEPS))
    check_resumed(reference, killed, resumed, KILL, STEPS - 1)
    state = fp.load_checkpoint(str(run_dir / "ckpt" / f"step-{STEPS - 1:08d}"))
    assert {"model_0", "optimizer_0", "scheduler_0", "custom_0", "step"} <= set(state)
    assert state["custom_0"] == {"seen": STEPS}


def test_two_processes_kill_and_resume_is_exact(tmp_path) -> None:
    """Launched like torchrun (MULTI_CPU, gloo): every process writes its share of the
    replicated state and its own RNG state; killed mid-write, resumed exactly."""
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    run_dir.mkdir(), ref_dir.mkdir()
    run_job(CHILD, [str(run_dir), random_kill(KILL, 2)], 2, str(tmp_path), killed=True)
    assert {c.step for c in fp.list_checkpoints(str(run_dir / "ckpt")) if c.committed} == {KILL - 2, KILL - 1}
    run_job(CHILD, [str(run_dir), "0", str(ref_dir)], 2, str(tmp_path))
    (reference,) = read_losses(str(ref_dir))
    killed, resumed = read_losses(str(run_dir))
    check_resumed(reference, killed, resumed, KILL, STEPS - 1)
    step_dir = str(run_dir / "ckpt" / f"step-{STEPS - 1:08d}")
    assert len([f for f in os.listdir(step_dir) if "-replicated-" in f and f.endswith(".bin")]) == 2
    assert all("torch" in fp.load_checkpoint(step_dir, rank=r, weights_only=False)["rng"] for r in range(2))


@pytest.mark.parametrize("kind, fsdp_version", [("FSDP", 1), ("DEEPSPEED", None), ("MEGATRON_LM", None)])
def test_engines_with_their_own_format_are_refused_before_anything_is_written(tmp_path, kind, fsdp_version) -> None:
    from accelerate.utils import DistributedType

    from fastpersist.integrations.accelerate import AcceleratorCheckpointer

    fake = types.SimpleNamespace(distributed_type=getattr(DistributedType, kind), is_fsdp2=False)
    with pytest.raises(fp.CheckpointError, match=kind if fsdp_version is None else "fsdp_version=1"):
        AcceleratorCheckpointer(fake, str(tmp_path / "ckpt"))  # type: ignore[arg-type]
    assert not (tmp_path / "ckpt").exists()


FSDP_CHILD = "integration_accelerate_fsdp_child.py"
FSDP_STEPS = 6
FSDP_KILL = 3


def test_fsdp2_kill_and_resume_is_exact_and_reshards(tmp_path) -> None:
    """accelerate's FSDP2 plugin over 2 gloo processes (see fsdp2_kill_resume_reshard)."""
    fsdp2_kill_resume_reshard(FSDP_CHILD, tmp_path, root="ckpt", model="model_0", optimizer="optimizer_0",
                              weight="0.weight", buffers_key="model_0", steps=FSDP_STEPS, kill=FSDP_KILL)


def test_fsdp2_optimizer_saved_before_its_first_step_is_left_as_it_is(tmp_path) -> None:
    """torch's optimizer state-dict functions step an optimizer without state once (zero
    gradients, lr 0): a save or a load before the first step must not leave it one step ahead."""
    run_job(FSDP_CHILD, [str(tmp_path), "save-before-the-first-step"], 2, str(tmp_path))


def test_fsdp2_checkpoint_resumes_without_fsdp_and_a_plain_one_is_refused_under_fsdp2(tmp_path) -> None:
    """An FSDP2 checkpoint loads into a ddp job (its tensors read whole, every value equal to
    the checkpoint's); a ddp checkpoint is refused under FSDP2, naming why, before the model,
    optimizer or any registered object is touched."""
    sharded, plain = tmp_path / "sharded", tmp_path / "plain"
    sharded.mkdir(), plain.mkdir()
    run_job(FSDP_CHILD, [str(sharded), "3", "0"], 2, str(tmp_path))
    saved = fp.open(shutil.copytree(str(sharded / "ckpt"), str(tmp_path / "saved")))  # before retention
    run_job(FSDP_CHILD, [str(sharded), "5", "0", "--plain"], 2, str(tmp_path))
    (_, resumed) = read_losses(str(sharded))
    assert sorted(resumed) == [3, 4]
    loaded = torch.load(str(sharded / "loaded.pt"), weights_only=False)
    state = saved.load(2)
    buffers = saved.load_rank_state(2, rank=0, weights_only=False)["model_buffers"]["model_0"]
    assert_state_equal(dict(sorted(loaded["model"].items())), dict(sorted({**state["model_0"], **buffers}.items())),
                       layout=False)
    assert_state_equal(loaded["optimizer"], state["optimizer_0"], layout=False)

    run_job(FSDP_CHILD, [str(plain), "3", "0", "--plain"], 2, str(tmp_path))
    with pytest.raises(AssertionError, match="model_0 was saved without FSDP2"):
        run_job(FSDP_CHILD, [str(plain), "5", "0"], 2, str(tmp_path))
