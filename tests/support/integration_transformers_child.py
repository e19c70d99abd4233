"""A Hugging Face Trainer run for the integration tests (tiny random-init GPT-2, CPU).

    python tests/integration_transformers_child.py DIR KILL_STEP RESUME [REFERENCE_DIR]

Trains STEPS optimizer steps with FastPersistTrainer, a checkpoint every step (save_steps=1,
save_total_limit=2), and appends "GLOBAL_STEP LOSS_HEX" for every logged step to
DIR/losses-<pid>.txt. The model has dropout, so the loss depends on the RNG states being
restored. KILL_STEP > 0: the writer thread SIGKILLs the process on its second write request of
the checkpoint of that step. RESUME=1 resumes from the latest committed checkpoint. With
REFERENCE_DIR, an uninterrupted run follows in the same process (saves an interpreter start).
Launched like torchrun (WORLD_SIZE > 1 in the environment), it trains with ddp over gloo.
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

from fastpersist.config import IOConfig
from fastpersist.storage.faults import FaultyBackend
from fastpersist.integrations.transformers import FastPersistTrainer
from helpers import leave
from integration_util import kill_faults

STEPS = 8


class LossLog(TrainerCallback):
    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001, ANN201 - HF's signature
        if logs and "loss" in logs and state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(f"{state.global_step} {float(logs['loss']).hex()}\n")


def dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 128, (64, 32), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def run(d: str, kill: str, resume: bool) -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=d, max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                             lr_scheduler_type="linear", warmup_steps=2, logging_steps=1, save_steps=1,
                             eval_strategy="steps", eval_steps=3,
                             save_total_limit=2, report_to=[], use_cpu=True, disable_tqdm=True, seed=42,
                             dataloader_num_workers=0,
                             ddp_backend="gloo" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    faults = kill_faults(kill, f"step-{int(kill.split(':')[0]):08d}")
    trainer = FastPersistTrainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset()[:8],
                                 callbacks=[LossLog(os.path.join(d, f"losses-{os.getpid()}.txt"))],
                                 fastpersist_kwargs={"backend": FaultyBackend(faults),
                                                     "config": IOConfig(chunk_bytes=64 * 1024, num_buffers=2)})
    trainer.train(resume_from_checkpoint=True if resume else None)


def main() -> None:
    d, kill, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    run(d, kill, resume)
    if len(sys.argv) > 4:
        run(sys.argv[4], "0", False)


if __name__ == "__main__":
    main()
    leave()  # the job has reported; see helpers.leave
