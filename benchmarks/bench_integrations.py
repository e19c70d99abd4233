"""Checkpointing overhead inside each framework: its own checkpointing vs fastpersist.

For Lightning, the Hugging Face Trainer and accelerate: the same model and data, a checkpoint
every N steps, trained on the CPU with one intra-op thread (as the demo: the other core stands
for the host cores a GPU job leaves free). Configurations per framework, interleaved round by
round so the disk's drift hits all alike:

- none: no checkpoint;
- the framework's own checkpointing (Lightning ``TorchCheckpointIO`` and ``AsyncCheckpointIO``,
  ``Trainer`` ``save_steps``, ``Accelerator.save_state``);
- fastpersist sync and asynchronous (snapshot mode) through the integration.

For Lightning it also times the plugins' ``save_checkpoint`` calls directly (blocked time and
time until written), which the machine's noise hides less than steps per second.

Steps per second is measured from the end of the warm-up steps to the end of the last step
(every checkpoint's save call, and its background write where it overlaps, fall inside); the
table gives the median over rounds with [min-max], and the overhead per step against "none".

    python benchmarks/bench_integrations.py [--rounds 3] [--steps 26] [--every 5] [--frameworks lightning,transformers,accelerate]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

WARMUP = 3
D = 1024


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, D), nn.GELU())])


def batches(n: int, batch: int = 256) -> torch.Tensor:
    return torch.randn(n, batch, D, generator=torch.Generator().manual_seed(1))


def state_mb(model: nn.Module) -> float:
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6  # weights + AdamW moments


class Clock:
    """Step end times; steps/s over the measured window."""

    def __init__(self) -> None:
        self.ends: list[float] = []

    def tick(self) -> None:
        self.ends.append(time.perf_counter())

    def steps_per_s(self) -> float:
        window = self.ends[WARMUP - 1:]
        return (len(window) - 1) / (window[-1] - window[0])


# ------------------------------------------------------------------------------------ Lightning


def lightning_run(config: str, d: str, steps: int, every: int) -> float:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistCheckpointIO

    clock = Clock()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            x = batch
            return nn.functional.mse_loss(self.net(x), x.flip(-1))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Tick(Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            clock.tick()

    io = {"none": None, "lightning torch.save": TorchCheckpointIO(),
          "lightning AsyncCheckpointIO": AsyncCheckpointIO(TorchCheckpointIO()),
          "fastpersist sync (file)": FastPersistCheckpointIO("file"),
          "fastpersist async": AsyncFastPersistCheckpointIO()}[config]
    callbacks: list[Any] = [Tick()]
    if io is not None:
        callbacks.append(ModelCheckpoint(dirpath=d, filename="{step}", every_n_train_steps=every, save_top_k=2,
                                         monitor="step", mode="max"))
    trainer = pl.Trainer(accelerator="cpu", max_steps=steps, plugins=[io] if io else None, callbacks=callbacks,
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=io is not None)
    tensors: Any = list(batches(steps))  # a list serves as a map-style dataset
    data = torch.utils.data.DataLoader(tensors, batch_size=None)
    trainer.fit(Module(), data)
    return clock.steps_per_s()


# ------------------------------------------------------------------------------ transformers


def transformers_run(config: str, d: str, steps: int, every: int) -> float:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from fastpersist.integrations.transformers import FastPersistTrainer

    clock = Clock()

    class Tick(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            clock.tick()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=64, n_embd=256, n_layer=4, n_head=4))
    ids = torch.randint(0, 8192, (steps * 8, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    save = config != "none"
    args = TrainingArguments(output_dir=d, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-4,
                             save_strategy="steps" if save else "no", save_steps=every, save_total_limit=2,
                             logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
    if config.startswith("fastpersist"):
        mode = "sync" if "sync" in config else "snapshot"
        trainer: Any = FastPersistTrainer(model=model, args=args, train_dataset=data, callbacks=[Tick()],
                                          fastpersist_mode=mode)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Tick()])
    trainer.train()
    return clock.steps_per_s()


# -------------------------------------------------------------------------------- accelerate


def accelerate_run(config: str, d: str, steps: int, every: int) -> float:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from fastpersist.integrations.accelerate import AcceleratorCheckpointer

    clock = Clock()
    project = ProjectConfiguration(project_dir=d, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=project)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    ckpt = None
    if config.startswith("fastpersist"):
        ckpt = AcceleratorCheckpointer(accelerator, os.path.join(d, "fp"), keep=2,
                                       mode="sync" if "sync" in config else "snapshot")
    for step, x in enumerate(batches(steps), 1):
        loss = nn.functional.mse_loss(model(x), x.flip(-1))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        clock.tick()
        if step % every == 0 and config != "none":
            if ckpt is not None:
                ckpt.save_state(step)
            else:
                accelerator.save_state()
    if ckpt is not None:
        ckpt.close()
    return clock.steps_per_s()


def lightning_blocked(base: str, rounds: int) -> str:
    """Time inside ``CheckpointIO.save_checkpoint`` (what blocks training) and until the checkpoint
    is written, for Lightning's plugins and fastpersist's, on the MLP's 50 MB checkpoint dict."""
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from fastpersist.integrations.lightning import AsyncFastPersistCheckpointIO, FastPersistCheckpointIO

    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, D)).sum().backward()
    opt.step()
    checkpoint = {"state_dict": model.state_dict(), "optimizer_states": [opt.state_dict()], "global_step": 1}
    plugins: dict[str, Callable[[], Any]] = {
        "lightning torch.save": TorchCheckpointIO, "lightning AsyncCheckpointIO": lambda: AsyncCheckpointIO(TorchCheckpointIO()),
        "fastpersist sync (file)": lambda: FastPersistCheckpointIO("file"),
        "fastpersist sync (sharded)": lambda: FastPersistCheckpointIO("sharded"),
        "fastpersist async": AsyncFastPersistCheckpointIO}
    calls: dict[str, list[float]] = {k: [] for k in plugins}
    totals: dict[str, list[float]] = {k: [] for k in plugins}
    d = tempfile.mkdtemp(prefix="bench-int-", dir=base)
    ios = {k: make() for k, make in plugins.items()}
    for i in range(rounds * 3):
        for k, io in ios.items():
            t0 = time.perf_counter()
            io.save_checkpoint(checkpoint, os.path.join(d, f"{k.replace(' ', '_')}-{i}.ckpt"))
            t1 = time.perf_counter()
            if hasattr(io, "wait"):
                io.wait()
            elif isinstance(io, AsyncCheckpointIO):
                io.teardown()
            calls[k].append(t1 - t0)
            totals[k].append(time.perf_counter() - t0)
    for io in ios.values():
        io.teardown()
    shutil.rmtree(d, ignore_errors=True)
    lines = ["\nLightning CheckpointIO, one 50 MB checkpoint (medians [min-max] of %d saves)\n" % (rounds * 3),
             "| plugin | blocked in save_checkpoint (ms) | until written (ms) |", "|---|---|---|"]
    for k in plugins:
        c, t = sorted(calls[k]), sorted(totals[k])
        lines.append(f"| {k} | {statistics.median(c) * 1e3:.1f} [{c[0] * 1e3:.1f}-{c[-1] * 1e3:.1f}] | "
                     f"{statistics.median(t) * 1e3:.1f} [{t[0] * 1e3:.1f}-{t[-1] * 1e3:.1f}] |")
    return "\n".join(lines)


FRAMEWORKS: dict[str, tuple[Callable[[str, str, int, int], float], list[str]]] = {
    "lightning": (lightning_run, ["none", "lightning torch.save", "lightning AsyncCheckpointIO",
                                  "fastpersist sync (file)", "fastpersist async"]),
    "transformers": (transformers_run, ["none", "Trainer save_steps", "fastpersist sync", "fastpersist async"]),
    "accelerate": (accelerate_run, ["none", "Accelerator.save_state", "fastpersist sync", "fastpersist async"]),
}


def measure(name: str, rounds: int, steps: int, every: int, base: str) -> dict[str, list[float]]:
    run, configs = FRAMEWORKS[name]
    out: dict[str, list[float]] = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs:
            d = tempfile.mkdtemp(prefix="bench-int-", dir=base)
            try:
                out[c].append(run(c, d, steps, every))
            finally:
                shutil.rmtree(d, ignore_errors=True)
            print(f"  round {r + 1} {name:12s} {c:30s} {out[c][-1]:.3f} steps/s", flush=True)
    return out


def table(name: str, results: dict[str, list[float]], every: int) -> str:
    none = statistics.median(results["none"])
    lines = [f"\n{name} (checkpoint every {every} steps)\n",
             "| configuration | steps/s median [min-max] | overhead per step |", "|---|---|---|"]
    for c, values in results.items():
        med = statistics.median(values)
        over = "-" if c == "none" else f"{(none / med - 1) * 100:+.1f}%"
        lines.append(f"| {c} | {med:.3f} [{min(values):.3f}-{max(values):.3f}] | {over} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=26)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--frameworks", default="lightning,transformers,accelerate")
    p.add_argument("--dir", default=os.path.join(os.getcwd(), ".bench-integrations"),
                   help="checkpoint directory (on the disk under test)")
    a = p.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for noisy in ("lightning", "lightning.pytorch", "transformers", "accelerate", "fastpersist"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    os.makedirs(a.dir, exist_ok=True)
    print(f"MLP state {state_mb(mlp()):.0f} MB (weights + AdamW); {os.cpu_count()} cores, 1 training thread; "
          f"checkpoints in {a.dir}", flush=True)
    tables = [table(n, measure(n, a.rounds, a.steps, a.every, a.dir), a.every) for n in a.frameworks.split(",")]
    if "lightning" in a.frameworks.split(","):
        tables.append(lightning_blocked(a.dir, a.rounds))
    print("\n".join(tables))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
