"""Checkpointing overhead inside each framework: its own checkpointing vs fastpersist.

For Lightning, the Hugging Face Trainer and accelerate: the same model and data, a checkpoint
every N steps, trained on the CPU with one intra-op thread per process (as the demo: the other
core stands for the host cores a GPU job leaves free). Configurations per framework:

- none: no checkpoint;
- the framework's own checkpointing (Lightning ``TorchCheckpointIO`` and ``AsyncCheckpointIO``,
  ``Trainer`` ``save_steps``, ``Accelerator.save_state``);
- fastpersist sync and asynchronous (snapshot mode) through the integration;
- multi-process rows (2 processes launched like torchrun, gloo): Lightning ddp with its own
  ``DDPStrategy`` (rank 0 writes) vs ``FastPersistDDPStrategy`` (every rank writes its share),
  the Trainer vs ``FastPersistTrainer``.

The demo's method: every round runs each configuration once, in a rotated order (so the disk's
drift and the machine's load hit all alike); a configuration's overhead is the median over
rounds of its per-step time divided by "none"'s in the same round, minus 1, with a 95%
bootstrap interval over rounds ("within noise" when the interval holds 0). Per-step time is
measured from the end of the warm-up steps to the end of the last step, so every save call and
any background write it overlaps fall inside. "Blocked per save" is the time the training
thread spent inside the framework's save call (Lightning's ``Trainer.save_checkpoint``, the
Trainer's ``_save_checkpoint``, ``save_state``), median [min-max] over every save of every round.

    python benchmarks/bench_integrations.py [--rounds 6] [--steps 21] [--every 5]
        [--frameworks lightning,transformers,accelerate,lightning-ddp,transformers-ddp]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from _bench.stats import median_spread, overhead

WARMUP = 3
D = 1024


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(D, D), nn.GELU())])


def batches(n: int, batch: int = 256) -> torch.Tensor:
    return torch.randn(n, batch, D, generator=torch.Generator().manual_seed(1))


def state_mb(model: nn.Module) -> float:
    return 3 * sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6  # weights + AdamW moments


@dataclass
class Run:
    """One training run: step end times and the time spent in each save call."""

    ends: list[float] = field(default_factory=list)
    blocked: list[float] = field(default_factory=list)

    def tick(self) -> None:
        self.ends.append(time.perf_counter())

    def step_s(self) -> float:
        window = self.ends[WARMUP - 1:]
        return (window[-1] - window[0]) / (len(window) - 1)

    def timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn``, recording how long each call blocks its caller."""
        def call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.blocked.append(time.perf_counter() - t0)
        return call

    def result(self) -> dict[str, Any]:
        return {"step_s": self.step_s(), "blocked": self.blocked}


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


# ------------------------------------------------------------------------------------ Lightning


def lightning_run(config: str, d: str, steps: int, every: int, devices: int = 1) -> dict[str, Any]:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from fastpersist.integrations.lightning import (AsyncFastPersistCheckpointIO, FastPersistCheckpointIO,
                                                    FastPersistDDPStrategy)

    run = Run()

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
            run.tick()

    io = {"none": None, "lightning torch.save": TorchCheckpointIO(),
          "lightning AsyncCheckpointIO": AsyncCheckpointIO(TorchCheckpointIO()),
          "fastpersist sync (file)": FastPersistCheckpointIO("file"),
          "fastpersist async": AsyncFastPersistCheckpointIO()}[config]
    callbacks: list[Any] = [Tick()]
    if io is not None:
        callbacks.append(ModelCheckpoint(dirpath=d, filename="{step}", every_n_train_steps=every, save_top_k=2,
                                         monitor="step", mode="max"))
    strategy: Any = "auto"
    plugins = [io] if io is not None else None
    if devices > 1:  # ddp: Lightning's own strategy (rank 0 writes), or fastpersist's (every rank writes)
        strategy = FastPersistDDPStrategy(checkpoint_io=io, process_group_backend="gloo") \
            if config.startswith("fastpersist") else "ddp"
        plugins = None if config.startswith("fastpersist") else plugins
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, plugins=plugins,
                         callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=io is not None, use_distributed_sampler=False)
    trainer.save_checkpoint = run.timed(trainer.save_checkpoint)  # what ModelCheckpoint calls
    tensors: Any = list(batches(steps))  # a list serves as a map-style dataset
    data = torch.utils.data.DataLoader(tensors, batch_size=None)
    trainer.fit(Module(), data)
    return run.result()


# ------------------------------------------------------------------------------ transformers


def transformers_run(config: str, d: str, steps: int, every: int, devices: int = 1) -> dict[str, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    from fastpersist.integrations.transformers import FastPersistTrainer

    run = Run()

    class Tick(TrainerCallback):
        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            run.tick()

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=8192, n_positions=64, n_embd=256, n_layer=4, n_head=4))
    ids = torch.randint(0, 8192, (steps * 8 * devices, 64), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    save = config != "none"
    args = TrainingArguments(output_dir=d, max_steps=steps, per_device_train_batch_size=8, learning_rate=1e-4,
                             save_strategy="steps" if save else "no", save_steps=every, save_total_limit=2,
                             logging_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True,
                             ddp_backend="gloo" if devices > 1 else None)
    if config.startswith("fastpersist"):
        mode = "sync" if "sync" in config else "snapshot"
        trainer: Any = FastPersistTrainer(model=model, args=args, train_dataset=data, callbacks=[Tick()],
                                          fastpersist_mode=mode)
    else:
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[Tick()])
    trainer._save_checkpoint = run.timed(trainer._save_checkpoint)  # where both Trainers save
    trainer.train()
    return run.result()


# -------------------------------------------------------------------------------- accelerate


def accelerate_run(config: str, d: str, steps: int, every: int, devices: int = 1) -> dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    from fastpersist.integrations.accelerate import AcceleratorCheckpointer

    run = Run()
    project = ProjectConfiguration(project_dir=d, automatic_checkpoint_naming=True, total_limit=2)
    accelerator = Accelerator(cpu=True, project_config=project)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = accelerator.prepare(model, opt)
    ckpt = None
    if config.startswith("fastpersist"):
        ckpt = AcceleratorCheckpointer(accelerator, os.path.join(d, "fp"), keep=2,
                                       mode="sync" if "sync" in config else "snapshot")
    save = run.timed(ckpt.save_state if ckpt is not None else lambda step: accelerator.save_state())
    for step, x in enumerate(batches(steps), 1):
        loss = nn.functional.mse_loss(model(x), x.flip(-1))
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
        run.tick()
        if step % every == 0 and config != "none":
            save(step)
    if ckpt is not None:
        ckpt.close()
    return run.result()


FRAMEWORKS: dict[str, tuple[Callable[..., dict[str, Any]], list[str], int]] = {
    "lightning": (lightning_run, ["none", "lightning torch.save", "lightning AsyncCheckpointIO",
                                  "fastpersist sync (file)", "fastpersist async"], 1),
    "transformers": (transformers_run, ["none", "Trainer save_steps", "fastpersist sync", "fastpersist async"], 1),
    "accelerate": (accelerate_run, ["none", "Accelerator.save_state", "fastpersist sync", "fastpersist async"], 1),
    "lightning-ddp": (lightning_run, ["none", "lightning torch.save", "fastpersist async"], 2),
    # 4 processes on this machine's 2 cores: they contend for the CPU; not in the default list
    "lightning-ddp4": (lightning_run, ["none", "lightning torch.save", "fastpersist async"], 4),
    "transformers-ddp": (transformers_run, ["none", "Trainer save_steps", "fastpersist async"], 2),
}


def run_once(name: str, config: str, d: str, steps: int, every: int) -> dict[str, Any]:
    """One run of ``config``: in this process, or as a 2-process job launched like torchrun
    (rank 0 reports)."""
    fn, _, devices = FRAMEWORKS[name]
    if devices == 1:
        return fn(config, d, steps, every)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(d, "rank0.json")
    env = dict(os.environ, WORLD_SIZE=str(devices), LOCAL_WORLD_SIZE=str(devices), MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), GROUP_RANK="0", TORCHELASTIC_RUN_ID=f"bench-{port}", OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, __file__, "--child", name, config, d, str(steps), str(every), out],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for r in range(devices)]
    try:
        errors = [p.communicate(timeout=1800)[1] for p in procs]
    finally:  # a rank that failed leaves the other waiting in a collective
        for p in procs:
            p.kill()
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError(f"{name} {config}: a rank failed:\n" + "\n".join(e[-2000:] for e in errors))
    with open(out) as f:
        return dict(json.load(f))


def child(name: str, config: str, d: str, steps: int, every: int, out: str) -> None:
    """A rank of a multi-process run: rank 0 writes what it measured to ``out``."""
    quiet()
    result = FRAMEWORKS[name][0](config, d, steps, every, FRAMEWORKS[name][2])
    if rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)


def measure(name: str, rounds: int, steps: int, every: int, base: str) -> dict[str, list[dict[str, Any]]]:
    configs = FRAMEWORKS[name][1]
    out: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(rounds):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:  # rotated order
            d = tempfile.mkdtemp(prefix="bench-int-", dir=base)
            try:
                out[c].append(run_once(name, c, d, steps, every))
            finally:
                shutil.rmtree(d, ignore_errors=True)
            print(f"  round {r + 1} {name:16s} {c:30s} {out[c][-1]['step_s'] * 1e3:.0f} ms/step", flush=True)
    return out


def table(name: str, results: dict[str, list[dict[str, Any]]]) -> list[str]:
    base = [x["step_s"] for x in results["none"]]
    rows = []
    for c, runs in results.items():
        steps = [x["step_s"] * 1e3 for x in runs]
        blocked = [b * 1e3 for x in runs for b in x["blocked"]]
        over = "-" if c == "none" else str(overhead(base, [x["step_s"] for x in runs]))
        rows.append(f"| {name} | {c} | {median_spread(steps, 0)} | {over} | {median_spread(blocked, 1)} |")
    return rows


def quiet() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for noisy in ("lightning", "lightning.pytorch", "lightning.fabric", "transformers", "accelerate", "fastpersist"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        name, config, d, steps, every, out = sys.argv[2:8]
        child(name, config, d, int(steps), int(every), out)
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--steps", type=int, default=21)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--frameworks", default=",".join(k for k in FRAMEWORKS if k != "lightning-ddp4"))
    p.add_argument("--dir", default=os.path.join(os.getcwd(), ".bench-integrations"),
                   help="checkpoint directory (on the disk under test)")
    a = p.parse_args()
    quiet()
    os.makedirs(a.dir, exist_ok=True)
    print(f"MLP state {state_mb(mlp()):.0f} MB (weights + AdamW); {os.cpu_count()} cores, 1 training thread per "
          f"process; a checkpoint every {a.every} steps; checkpoints in {a.dir}", flush=True)
    rows = ["| framework | configuration | ms per step, median [min-max] | overhead per step vs none "
            "(paired by round, 95% CI) | blocked per save, ms |", "|---|---|---|---|---|"]
    for name in a.frameworks.split(","):
        rows += table(name, measure(name, a.rounds, a.steps, a.every, a.dir))
    print("\n" + "\n".join(rows))
    shutil.rmtree(a.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
