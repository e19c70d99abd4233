"""Hugging Face Trainer with fastpersist: ``save_steps`` checkpoints written in the background.

    python examples/transformers_example.py [OUTPUT_DIR]

Trains a tiny random-init Llama (no download) on random tokens for 20 steps on the CPU with a
checkpoint every 5 steps (keeping 2), then a new Trainer resumes from the latest checkpoint
with ``resume_from_checkpoint=True`` and trains to step 30. Well under a minute.
"""

from __future__ import annotations

import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainingArguments

import fastpersist as fp
from fastpersist.integrations.transformers import FastPersistTrainer


def dataset() -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 256, (256, 64), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": x, "labels": x} for x in ids]


def trainer(output_dir: str, steps: int) -> FastPersistTrainer:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    args = TrainingArguments(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=1e-3, logging_steps=5, save_steps=5, save_total_limit=2,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    return FastPersistTrainer(model=LlamaForCausalLM(config), args=args, train_dataset=dataset())


def main() -> None:
    output_dir = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp(prefix="fastpersist-hf-")
    trainer(output_dir, 20).train()
    first = trainer(output_dir, 30)
    print("checkpoints:", [(c.step, c.committed) for c in fp.list_checkpoints(first.fastpersist_roots[0])])
    first.train(resume_from_checkpoint=True)
    print(f"resumed and trained to step {first.state.global_step}; checkpoints in {first.fastpersist_roots[0]}")


if __name__ == "__main__":
    main()
