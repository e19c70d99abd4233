"""What the integrations share for FSDP2 models: their state as torch's state-dict functions
give it (DTensors keyed by parameter name), which fastpersist writes chunk by chunk from their
owners and reads back into the current mesh's DTensors at any number of processes.

torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` are what DCP's users save and
what accelerate's own sharded save takes; the optimizer's state is keyed by parameter name, so
it loads whatever the mesh.

One correction to torch's functions: for an optimizer without state (not stepped yet) they
initialise it with a step of zero gradients at lr 0 (``_init_optim_state``), so that a save
before the first step, or a load, would leave AdamW one step ahead (its step count at 1, and
the first real update with the wrong bias correction). fastpersist saves such an optimizer as
it is, with no state, and leaves it without state after loading a checkpoint that has none.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)

from fastpersist.errors import CheckpointError


def model_state(model: Any, *, cpu_offload: bool = False) -> dict[str, Any]:
    """An FSDP2 model's sharded state dict. ``cpu_offload``: copies on the CPU (load templates)
    instead of the live DTensors."""
    return get_model_state_dict(model, options=StateDictOptions(cpu_offload=cpu_offload))


def optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The sharded state dict of ``model``'s optimizer (an accelerate wrapper is unwrapped), as
    it is: an optimizer that has not stepped yet has no state."""
    inner = _inner(optimizer)
    fresh = not inner.state
    state = get_optimizer_state_dict(model, inner)
    if fresh:  # torch initialised it (see the module): undo that
        inner.state.clear()
        state = {**state, "state": {}}
    return state


def optimizer_template(model: Any, optimizer: Any) -> dict[str, Any]:
    """CPU copies of the optimizer's sharded state to load into (initialised if need be)."""
    return get_optimizer_state_dict(model, _inner(optimizer), options=StateDictOptions(cpu_offload=True))


def set_model_state(model: Any, state: dict[str, Any]) -> None:
    """Hand a loaded (CPU) state dict back to an FSDP2 model."""
    set_model_state_dict(model, state, options=StateDictOptions(cpu_offload=True))


def set_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Hand a loaded (CPU) state dict back to ``model``'s optimizer; one saved without state
    (before its first step) leaves it without state."""
    inner = _inner(optimizer)
    set_optimizer_state_dict(model, inner, state, options=StateDictOptions(cpu_offload=True))
    if not state.get("state"):
        inner.state.clear()


def sharded_names(templates: dict[str, dict[str, Any]]) -> dict[str, list[str]]:
    """The names of the DTensors of each model's template (taken before a load fills them)."""
    from torch.distributed.tensor import DTensor

    return {key: [name for name, t in template.items() if isinstance(t, DTensor)] for key, template in templates.items()}


def check_sharded(loaded: dict[str, Any], expected: dict[str, list[str]], where: str) -> None:
    """Refuse, before anything is handed to the model, a checkpoint whose model state was saved
    without FSDP2: its tensors come back whole where the job's model holds DTensors."""
    from torch.distributed.tensor import DTensor

    for key, names in expected.items():
        whole = [name for name in names if not isinstance(loaded.get(key, {}).get(name), DTensor)]
        if whole:
            raise CheckpointError(
                f"{where}: {key} was saved without FSDP2 ({whole[0]!r} is a whole tensor, not a DTensor) and this "
                "job shards it with FSDP2; fastpersist does not convert a plain checkpoint to FSDP2: resume it "
                "without FSDP (and save again under FSDP2)")


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
