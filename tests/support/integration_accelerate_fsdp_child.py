"""An accelerate FSDP2 training loop for the integration tests (fsdp_version=2, CPU, gloo).

    python tests/integration_accelerate_fsdp_child.py DIR STEPS KILL_STEP [RESUME_STEP] [--plain]
    python tests/integration_accelerate_fsdp_child.py DIR save-before-the-first-step

Trains a tiny random-init MLP (dropout, BatchNorm) to STEPS steps with accelerate's
``FullyShardedDataParallelPlugin(fsdp_version=2)``, a checkpoint every step through
AcceleratorCheckpointer in DIR/ckpt, resuming from checkpoint RESUME_STEP, or else from the
latest one when there is one (the ddp child's loop, ``integration_accelerate_child.run``). Rank 0 appends "STEP LOSS_HEX" to DIR/losses-<pid>.txt, and after a resume saves the full
(unsharded) model and optimizer state it loaded to DIR/loaded.pt. KILL_STEP as in
``integration_util.kill_faults``. ``--plain``: the same without FSDP (ddp). Launched like
torchrun (1 or more processes).

accelerate runs FSDP only on accelerators: the child tells it the device is one
(``integration_util.pretend_accelerator_fsdp2``); everything else is real.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from fastpersist.integrations.accelerate import AcceleratorCheckpointer
from helpers import leave
from integration_accelerate_child import run
from integration_util import pretend_accelerator_fsdp2


def accelerator_with_fsdp2() -> Accelerator:
    if not dist.is_initialized():  # one process: accelerate starts no process group on a CPU
        dist.init_process_group("gloo")
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, cpu_ram_efficient_loading=False)
    accelerator = Accelerator(cpu=True, fsdp_plugin=plugin,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    pretend_accelerator_fsdp2(plugin)
    if not accelerator.is_fsdp2:
        raise RuntimeError("accelerate did not take the FSDP2 plugin")
    return accelerator


def save_loaded(d: str) -> Callable[[Accelerator, nn.Module, Any], None]:
    def save(accelerator: Accelerator, model: nn.Module, opt: Any) -> None:
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        loaded = {"model": get_model_state_dict(model, options=full),
                  "optimizer": get_optimizer_state_dict(model, opt.optimizer, options=full)}
        if accelerator.is_main_process:
            torch.save(loaded, os.path.join(d, "loaded.pt"))
    return save


def save_before_the_first_step(d: str) -> None:
    """A checkpoint saved (and loaded) before the optimizer's first step leaves it as it is."""
    accelerator = accelerator_with_fsdp2()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32))
    model, opt = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with AcceleratorCheckpointer(accelerator, os.path.join(d, "ckpt")) as ckpt:
        ckpt.save_state(0).wait()
        if opt.optimizer.state:
            raise RuntimeError(f"saving before the first step gave the optimizer state: {opt.optimizer.state}")
        ckpt.load_state(0)
        if opt.optimizer.state:
            raise RuntimeError("loading a checkpoint saved before the first step gave the optimizer state")
        accelerator.backward(model(torch.randn(4, 32)).square().mean())
        opt.step()
        ckpt.save_state(1).wait()
        ckpt.load_state(1)
        steps = sorted({float(s["step"]) for s in opt.optimizer.state.values()})
        if steps != [1.0]:
            raise RuntimeError(f"after one step (saved and loaded) the optimizer's step counts are {steps}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--plain"]
    d = args[0]
    if args[1] == "save-before-the-first-step":
        save_before_the_first_step(d)
    else:
        accelerator = None if "--plain" in sys.argv else accelerator_with_fsdp2()
        run(d, args[2], steps=int(args[1]), accelerator=accelerator,
            resume_step=int(args[3]) if len(args) > 3 else None, after_load=save_loaded(d))
    leave()  # the job has reported; see helpers.leave
