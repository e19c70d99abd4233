"""``Accelerator.save_state`` / ``load_state`` through a fastpersist Checkpointer.

::

    from accelerate import Accelerator
    from fastpersist.integrations.accelerate import AcceleratorCheckpointer

    accelerator = Accelerator()
    model, optimizer, data, scheduler = accelerator.prepare(model, optimizer, data, scheduler)
    accelerator.register_for_checkpointing(my_stateful_object)
    ckpt = AcceleratorCheckpointer(accelerator, "/nvme0/run1", keep=3)
    latest = ckpt.latest_step()
    start = 0 if latest is None else ckpt.load_state(latest, load_rng=False)["step"] + 1
    for step, batch in enumerate(accelerator.skip_first_batches(data, start), start):
        if step == start and latest is not None:
            ckpt.load_rng_state(latest)                 # after the loader drew its seed
        ...
        ckpt.save_state(step)                           # returns at once; written in the background

What is saved is what ``Accelerator.save_state`` saves: every prepared model (unwrapped),
optimizer and LR scheduler, the gradient scaler, the state of stateful data loaders
(``use_stateful_dataloader``), every object registered with ``register_for_checkpointing``,
the accelerator's step, and each process's RNG states (Python, numpy, torch, CUDA). Under
``accelerate launch`` every process must call ``save_state`` (the replicated state is written
once, split over all processes; each process's RNG state is its own); ``load_state`` works at
any world size.

The objects come from the Accelerator's registries (``_models``, ``_optimizers``,
``_schedulers``, ``_dataloaders``, ``_custom_objects``), as ``Accelerator.save_state`` reads
them: accelerate has no public accessor for them, so this module reads them in one place
(:func:`registered`). The ``register_save_state_pre_hook`` / ``register_load_state_pre_hook``
hooks belong to accelerate's own file layout (they receive its output directory) and are not
called.

Not supported (a clear error): FSDP, DeepSpeed and Megatron-LM, whose state is sharded over
processes. accelerate turns them on only for accelerator processes (never for CPU processes),
so this adapter's sharded path could not be tested here, and is refused rather than shipped
untested (see docs/INTEGRATIONS.md).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from accelerate import Accelerator
from accelerate.utils import DistributedType

from fastpersist.checkpointer import Checkpointer
from fastpersist.errors import CheckpointError
from fastpersist.handle import SaveHandle
from fastpersist.state import RNGState

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorCheckpointer", "registered"]

_SHARDED = ("FSDP", "DEEPSPEED", "MEGATRON_LM")


def registered(accelerator: Accelerator) -> dict[str, Any]:
    """The objects ``Accelerator.save_state`` saves, keyed ``model_0``, ``optimizer_0``, ...

    Args:
        accelerator: an Accelerator after ``prepare`` (and ``register_for_checkpointing``).

    Returns:
        A dict of stateful objects (with ``state_dict`` / ``load_state_dict``).
    """
    out: dict[str, Any] = {}
    for i, model in enumerate(accelerator._models):
        out[f"model_{i}"] = accelerator.unwrap_model(model)
    for i, opt in enumerate(accelerator._optimizers):
        out[f"optimizer_{i}"] = opt
    for i, sched in enumerate(accelerator._schedulers):
        out[f"scheduler_{i}"] = sched
    for i, loader in enumerate(accelerator._dataloaders):
        if getattr(loader, "use_stateful_dataloader", False):
            out[f"dataloader_{i}"] = loader
    if accelerator.scaler is not None:
        out["scaler"] = accelerator.scaler
    for i, obj in enumerate(accelerator._custom_objects):
        out[f"custom_{i}"] = obj
    return out


class AcceleratorCheckpointer:
    """Checkpoints of an ``Accelerator``'s training state, written by a Checkpointer.

    Args:
        accelerator: the Accelerator whose prepared and registered objects are saved.
        roots: checkpoint root directories (one per SSD), the same on every process.
        mode: ``"snapshot"`` (default: ``save_state`` returns once the state is copied; the
            write overlaps the next steps), ``"overlap"`` (prepared optimizers are protected:
            their step waits only for their own tensors) or ``"sync"``.
        **checkpointer_kwargs: further :class:`fastpersist.Checkpointer` arguments (``keep``,
            ``keep_every``, ``snapshot_bytes``, ``config``, ...).

    Raises:
        CheckpointError: the accelerator shards its state (FSDP, DeepSpeed, Megatron-LM).
    """

    def __init__(self, accelerator: Accelerator, roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 *, mode: str = "snapshot", **checkpointer_kwargs: Any) -> None:
        _check_supported(accelerator)
        self.accelerator = accelerator
        self.checkpointer = Checkpointer(roots, mode=mode, **checkpointer_kwargs)
        self._protected = False

    def save_state(self, step: int, extra: dict[str, Any] | None = None) -> SaveHandle:
        """Checkpoint the training state as ``step`` (call on every process).

        Args:
            step: the checkpoint's step number (the loop's own counter).
            extra: more values to save (replicated: the same on every process).

        Returns:
            The Checkpointer's handle (``wait()`` for the commit).
        """
        _check_supported(self.accelerator)
        objects = registered(self.accelerator)
        if self.checkpointer.mode == "overlap" and not self._protected:
            for key, opt in objects.items():
                if key.startswith("optimizer_"):
                    self.checkpointer.protect(getattr(opt, "optimizer", opt))
            self._protected = True
        # a model's buffers (BatchNorm statistics) differ between ddp processes: rank 0's are saved
        models = {k: _apart(v) for k, v in objects.items() if k.startswith("model_")}
        state = {**objects, **{k: params for k, (params, _) in models.items()}, "step": step,
                 "accelerator_step": self.accelerator.step, "extra": dict(extra or {})}
        own: dict[str, Any] = {"rng": RNGState()}
        if self.checkpointer.rank == 0:
            own["model_buffers"] = {k: buffers for k, (_, buffers) in models.items()}
        return self.checkpointer.save(step, state, rank_state=own, metadata={"trainer": "accelerate", "step": step})

    def load_state(self, step: int | str = "latest", *, load_rng: bool = True) -> dict[str, Any]:
        """Restore a checkpoint in place: every registered object, the step counter, the RNG.

        Args:
            step: a step number or ``"latest"``.
            load_rng: restore this process's RNG states (saved by the process of the same rank).

        Returns:
            The loaded state: ``"step"``, ``"extra"`` and the objects' state dicts.
        """
        _check_supported(self.accelerator)
        self.checkpointer.wait()
        objects = registered(self.accelerator)
        state = self.checkpointer.load(step, into={k: v for k, v in objects.items() if not k.startswith("model_")})
        buffers = self.checkpointer.load_rank_state(state["step"], rank=0).get("model_buffers", {})
        for key, model in objects.items():
            if key.startswith("model_"):
                model.load_state_dict({**state[key], **buffers.get(key, {})})
        self.accelerator.step = int(state["accelerator_step"])
        if load_rng:
            self.load_rng_state(state["step"])
        return state

    def load_rng_state(self, step: int | str = "latest") -> None:
        """Restore this process's RNG states only.

        A data loader draws a seed from the global RNG when its iterator produces the first
        batch; to resume bit for bit, restore the RNG after that (``load_state(step,
        load_rng=False)``, fetch the first batch, then ``load_rng_state(step)``), as the
        Trainer does with its ``rng_to_sync``.

        Args:
            step: a step number or ``"latest"``.
        """
        self.checkpointer.load_rank_state(step, into={"rng": RNGState()})

    def latest_step(self) -> int | None:
        """The latest committed step, or None."""
        return self.checkpointer.latest_step()

    def wait(self) -> None:
        """Wait for the checkpoints in flight (raises a failure)."""
        self.checkpointer.wait()

    def close(self) -> None:
        """Wait for the checkpoints in flight and release the Checkpointer."""
        self.checkpointer.close()

    def __enter__(self) -> AcceleratorCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _apart(model: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's state dict split into its parameters and its buffers."""
    state = model.state_dict()
    names = {name for name, _ in model.named_buffers()}
    return ({k: v for k, v in state.items() if k not in names}, {k: v for k, v in state.items() if k in names})


def _check_supported(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if any(kind == getattr(DistributedType, name, None) for name in _SHARDED):
        raise CheckpointError(
            f"fastpersist cannot checkpoint an Accelerator with distributed_type={kind}: its model and optimizer "
            "state is sharded over processes, and accelerate runs it only on accelerators, where this adapter's "
            "sharded path has not been tested (use accelerator.save_state for it)")
