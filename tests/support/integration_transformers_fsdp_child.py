"""A Hugging Face Trainer run with FSDP2 for the integration tests (tiny GPT-2, CPU, gloo).

    python tests/integration_transformers_fsdp_child.py DIR STEPS KILL_STEP [RESUME_STEP]

The ddp child's run (``integration_transformers_child``: dropout, an evaluation every 3
steps, a checkpoint every step in DIR/fastpersist) with the Trainer's FSDP2 settings
(``fsdp_config={"fsdp_version": 2}``, one FSDP unit per GPT-2 block), STEPS optimizer steps.
It resumes from checkpoint RESUME_STEP, or else from the latest committed one when there is one; rank 0 then saves the full
(unsharded) model and optimizer state the Trainer holds after loading to DIR/loaded.pt. KILL_STEP as in
``integration_util.kill_faults``. Launched like torchrun (1 or more processes).

The Trainer asks accelerate for FSDP, which accelerate runs only on accelerators: the child
tells it the device is one (``integration_util.pretend_accelerator_fsdp2``); everything else
is real.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import fastpersist as fp
from fastpersist.config import IOConfig
from fastpersist.storage.faults import FaultyBackend
from fastpersist.integrations.transformers import FastPersistTrainer
from helpers import leave
from integration_transformers_child import LossLog, dataset
from integration_util import kill_faults, pretend_accelerator_fsdp2


class Trainer(FastPersistTrainer):
    """FastPersistTrainer on a pretended accelerator (see the module docstring); after a resume,
    rank 0 saves what was loaded."""

    loaded_to: str | None = None

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        pretend_accelerator_fsdp2(FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args))
        self.is_fsdp_enabled = True

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None or self.loaded_to is None:
            return
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        loaded: dict[str, Any] = {"model": get_model_state_dict(self.model, options=full),
                                  "optimizer": get_optimizer_state_dict(self.model, self.optimizer.optimizer,
                                                                        options=full)}
        if self.args.process_index == 0:
            torch.save(loaded, self.loaded_to)


def run(d: str, steps: int, kill: str, resume_step: int | None) -> None:
    if not dist.is_initialized():  # one process: the Trainer starts no process group on a CPU
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=2))
    args = TrainingArguments(output_dir=d, max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3,
                             lr_scheduler_type="constant", logging_steps=1, save_steps=1,
                             eval_strategy="steps", eval_steps=3, save_total_limit=2, report_to=[], use_cpu=True,
                             disable_tqdm=True, seed=42, dataloader_num_workers=0, ddp_backend="gloo", fsdp=True,
                             fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})
    faults = kill_faults(kill, f"step-{int(kill.split(':')[0]):08d}")
    trainer = Trainer(model=model, args=args, train_dataset=dataset(), eval_dataset=dataset()[:8],
                      callbacks=[LossLog(os.path.join(d, f"losses-{os.getpid()}.txt"))],
                      fastpersist_kwargs={"backend": FaultyBackend(faults),
                                          "config": IOConfig(chunk_bytes=64 * 1024, num_buffers=2)})
    if not trainer.is_fsdp_enabled:
        raise RuntimeError("the Trainer did not enable FSDP")
    root = os.path.join(d, "fastpersist")
    resume = os.path.isdir(root) and any(c.committed for c in fp.list_checkpoints(root))
    trainer.loaded_to = os.path.join(d, "loaded.pt") if resume else None
    trainer.train(resume_from_checkpoint=resume_step if resume_step is not None else True if resume else None)
    if not isinstance(trainer.model.transformer.h[0].attn.c_attn.weight, torch.distributed.tensor.DTensor):
        raise RuntimeError("the Trainer did not shard the model with FSDP2")


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]) if len(sys.argv) > 4 else None)
    leave()  # the job has reported; see helpers.leave
