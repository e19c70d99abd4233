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

FSDP2 (``FullyShardedDataParallelPlugin(fsdp_version=2)``): each model's and optimizer's state
is taken with torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (DTensors keyed
by parameter name, as accelerate's own sharded save takes it) and every process writes the
chunks it owns; ``load_state`` fills the current mesh's DTensors, at any number of processes
(resharding), and hands them back with ``set_model_state_dict`` / ``set_optimizer_state_dict``.
An optimizer belongs to the prepared model that owns its parameters. A checkpoint saved under
FSDP2 also loads without FSDP (its tensors read whole); one saved without FSDP is refused under
FSDP2 before anything is loaded.

Not supported (a clear error): FSDP1 (``fsdp_version=1``: flat parameters), DeepSpeed and
Megatron-LM, which keep their state in their own engines' formats.
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
from fastpersist.saving.handle import SaveHandle
from fastpersist.integrations import _fsdp2 as fsdp2
from fastpersist.state import RNGState, restore_into

logger = logging.getLogger(__name__)

__all__ = ["AcceleratorCheckpointer", "registered"]

_ENGINES = ("DEEPSPEED", "MEGATRON_LM")


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
        CheckpointError: the accelerator keeps its state in an engine of its own (FSDP1,
            DeepSpeed, Megatron-LM).
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
        # a model's buffers (BatchNorm statistics) differ between processes: rank 0's are saved
        models = {k: _apart(v, _model_state(self.accelerator, v)) for k, v in objects.items()
                  if k.startswith("model_")}
        if _fsdp2(self.accelerator):
            objects.update(_optimizer_states(objects))
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
        models = {k: v for k, v in objects.items() if k.startswith("model_")}
        others = {k: v for k, v in objects.items() if not k.startswith("model_")}
        if _fsdp2(self.accelerator):
            # templates: CPU copies of this process's DTensors at the current mesh, filled in place;
            # nothing live is touched until the checkpoint is known to be sharded
            templates = {k: fsdp2.model_state(v, cpu_offload=True) for k, v in models.items()}
            pairs = _pairs(objects)
            optimizers = {k: fsdp2.optimizer_template(model, opt) for k, model, opt in pairs}
            expected = fsdp2.sharded_names(templates)
            state = self.checkpointer.load(step, into={**templates, **optimizers})
            fsdp2.check_sharded(state, expected, f"{self.checkpointer.roots[0]}: step {state['step']}")
            restore_into(state, {k: v for k, v in others.items() if k not in optimizers},
                         str(self.checkpointer.roots[0]))
            for k, model, opt in pairs:
                fsdp2.set_optimizer_state(model, opt, state[k])
        else:  # the models' tensors are read whole (also from a checkpoint saved under FSDP2)
            state = self.checkpointer.load(step, into={**{k: {} for k in models}, **others})
        buffers = self.checkpointer.load_rank_state(state["step"], rank=0).get("model_buffers", {})
        for key, model in models.items():
            _set_model_state(self.accelerator, model, {**state[key], **buffers.get(key, {})})
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


def _apart(model: Any, state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A model's state dict split into its parameters and its buffers."""
    names = {name for name, _ in model.named_buffers()}
    return ({k: v for k, v in state.items() if k not in names}, {k: v for k, v in state.items() if k in names})


def _fsdp2(accelerator: Accelerator) -> bool:
    return bool(accelerator.distributed_type == DistributedType.FSDP and accelerator.is_fsdp2)


def _model_state(accelerator: Accelerator, model: Any, *, cpu_offload: bool = False) -> dict[str, Any]:
    """A model's state dict: its own, or under FSDP2 its sharded one."""
    return fsdp2.model_state(model, cpu_offload=cpu_offload) if _fsdp2(accelerator) else dict(model.state_dict())


def _set_model_state(accelerator: Accelerator, model: Any, state: dict[str, Any]) -> None:
    if _fsdp2(accelerator):
        fsdp2.set_model_state(model, state)
    else:
        model.load_state_dict(state)


def _pairs(objects: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """Under FSDP2, (key, model, optimizer) of each optimizer: the model owning its parameters."""
    models = [v for k, v in objects.items() if k.startswith("model_")]
    owner = {id(p): i for i, m in enumerate(models) for p in m.parameters()}
    out = []
    for key, opt in ((k, v) for k, v in objects.items() if k.startswith("optimizer_")):
        inner = getattr(opt, "optimizer", opt)
        found = {owner.get(id(p)) for group in inner.param_groups for p in group["params"]}
        if len(found) != 1 or None in found:
            raise CheckpointError(
                f"fastpersist saves an FSDP2 optimizer with the one prepared model that owns its parameters; the "
                f"parameters of {key} belong to {len(found - {None})} prepared models"
                f"{' and to none' if None in found else ''}")
        out.append((key, models[found.pop()], opt))  # type: ignore[index]
    return out


def _optimizer_states(objects: dict[str, Any]) -> dict[str, Any]:
    """Under FSDP2, each optimizer's sharded state dict."""
    return {k: fsdp2.optimizer_state(model, opt) for k, model, opt in _pairs(objects)}


def _check_supported(accelerator: Accelerator) -> None:
    kind = accelerator.distributed_type
    if any(kind == getattr(DistributedType, name, None) for name in _ENGINES) or (
            kind == DistributedType.FSDP and not accelerator.is_fsdp2):
        raise CheckpointError(
            f"fastpersist cannot checkpoint an Accelerator with distributed_type={kind}"
            f"{'' if kind != DistributedType.FSDP else ' and fsdp_version=1'}: its model and optimizer state lives "
            "in that engine's own format (flat parameters, engine shards); fastpersist saves FSDP2's DTensor state "
            "(FullyShardedDataParallelPlugin(fsdp_version=2)) — use accelerator.save_state for this one")
