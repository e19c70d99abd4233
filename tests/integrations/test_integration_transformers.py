"""Hugging Face Trainer through FastPersistTrainer: a real Trainer run (tiny GPT-2 with dropout)
killed with SIGKILL in the middle of writing a checkpoint, resumed from the latest committed
one, and compared loss by loss with an uninterrupted run; save_total_limit keeps working."""

from __future__ import annotations

import os

import fastpersist as fp
import pytest

from integration_util import (check_resumed, fsdp2_kill_resume_reshard, random_kill, read_losses, require, run_child,
                              run_job)

CHILD = "integration_transformers_child.py"
STEPS = 8
KILL = 4

require("transformers")
require("accelerate")


def test_kill_and_resume_is_exact(tmp_path) -> None:
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    run_dir.mkdir(), ref_dir.mkdir()
    root = str(run_dir / "fastpersist")
    run_child(CHILD, [str(run_dir), str(KILL), "0"], killed=True)
    listed = {c.step: c.committed for c in fp.list_checkpoints(root)}
    assert listed[KILL] is False  # killed while writing step KILL
    assert {s for s, c in listed.items() if c} == {KILL - 2, KILL - 1}
    # retention deletes in the background (manifest first): a kill may land while it removes an
    # older step's files, which then stays, uncommitted, until the next start cleans it
    assert all(not c and s < KILL - 2 for s, c in listed.items() if s not in (KILL - 2, KILL - 1, KILL))
    run_child(CHILD, [str(run_dir), "0", "1", str(ref_dir)])  # resume, then the uninterrupted run
    (reference,) = read_losses(str(ref_dir))
    killed, resumed = read_losses(str(run_dir))
    assert sorted(reference) == list(range(1, STEPS + 1))
    check_resumed(reference, killed, resumed, KILL, STEPS)
    # save_total_limit=2: the last two, committed; the partial one was cleaned by the resumed run
    assert [(c.step, c.committed) for c in fp.list_checkpoints(root)] == [(STEPS - 1, True), (STEPS, True)]
    step_dir = os.path.join(root, f"step-{STEPS:08d}")
    assert set(fp.load_checkpoint(step_dir)) == {"model", "optimizer", "scheduler"}  # replicated
    own = fp.load_checkpoint(step_dir, rank=0, weights_only=False)
    assert set(own) == {"trainer_state", "model_buffers", "rng"} and '"global_step": 8' in own["trainer_state"]


def _ddp_kill_and_resume(tmp_path, world: int) -> None:
    run_dir, ref_dir = tmp_path / "run", tmp_path / "ref"
    run_dir.mkdir(), ref_dir.mkdir()
    root = str(run_dir / "fastpersist")
    run_job(CHILD, [str(run_dir), random_kill(KILL, world), "0"], world, str(tmp_path), killed=True)
    assert {c.step for c in fp.list_checkpoints(root) if c.committed} == {KILL - 2, KILL - 1}
    run_job(CHILD, [str(run_dir), "0", "1", str(ref_dir)], world, str(tmp_path))
    (reference,) = read_losses(str(ref_dir))
    killed, resumed = read_losses(str(run_dir))  # rank 0 alone logs, in the resumed run too
    assert sorted(reference) == list(range(1, STEPS + 1))
    check_resumed(reference, killed, resumed, KILL, STEPS)
    # every rank wrote its share of the replicated state and its own RNG state
    step_dir = os.path.join(root, f"step-{STEPS:08d}")
    shares = [f for f in os.listdir(step_dir) if "-replicated-" in f and f.endswith(".bin")]
    assert len(shares) == world, shares
    assert all("torch" in fp.load_checkpoint(step_dir, rank=r, weights_only=False)["rng"] for r in range(world))
    # TrainerState (its log history holds each process's evaluation timings) is rank 0's own
    assert "trainer_state" not in fp.load_checkpoint(step_dir)
    assert '"global_step": 8' in fp.load_checkpoint(step_dir, rank=0, weights_only=False)["trainer_state"]


def test_ddp_two_processes_kill_and_resume_is_exact(tmp_path) -> None:
    """Under torchrun with 2 processes (ddp, gloo, an evaluation every 3 steps): the state was
    refused as "differs between ranks" (TrainerState's per-process flags and evaluation
    timings)."""
    _ddp_kill_and_resume(tmp_path, 2)


@pytest.mark.long
def test_ddp_four_processes_kill_and_resume_is_exact(tmp_path) -> None:
    _ddp_kill_and_resume(tmp_path, 4)


def test_fsdp2_kill_and_resume_is_exact_and_reshards(tmp_path) -> None:
    """The Trainer with FSDP2 (fsdp_config={"fsdp_version": 2}, one unit per GPT-2 block) over
    2 gloo processes (see fsdp2_kill_resume_reshard): the Trainer's FSDP was refused before."""
    fsdp2_kill_resume_reshard("integration_transformers_fsdp_child.py", tmp_path, root="fastpersist", model="model",
                              optimizer="optimizer", weight="transformer.h.0.attn.c_attn.weight", buffers_key=None,
                              steps=6, kill=3)


def test_fsdp1_is_refused_before_anything_is_written(tmp_path) -> None:
    from accelerate.state import AcceleratorState
    from accelerate.utils import FullyShardedDataParallelPlugin
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from fastpersist.integrations.transformers import FastPersistTrainer
    from integration_util import pretend_accelerator_fsdp2

    class Trainer(FastPersistTrainer):
        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            pretend_accelerator_fsdp2(FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
            self.is_fsdp_enabled = True

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], fsdp=True,
                             fsdp_config={"fsdp_version": 1, "sync_module_states": False})
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    try:
        with pytest.raises(fp.CheckpointError, match="FSDP1"):
            Trainer(model=model, args=args)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert not (tmp_path / "fastpersist").exists()
