"""What the integrations share for FSDP2 models: their state as torch's state-dict functions
give it (DTensors keyed by parameter name), which fastpersist writes chunk by chunk from their
owners and reads back into the current mesh's DTensors at any number of processes.

torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` are what DCP's users save and
what accelerate's own sharded save takes; the optimizer's state is keyed by parameter name, so
it loads whatever the mesh. Imported by an adapter only when its model is sharded.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)


def model_state(model: Any, *, cpu_offload: bool = False) -> dict[str, Any]:
    """An FSDP2 model's sharded state dict. ``cpu_offload``: copies on the CPU (load templates)
    instead of the live DTensors."""
    return get_model_state_dict(model, options=StateDictOptions(cpu_offload=cpu_offload))


def optimizer_state(model: Any, optimizer: Any, *, cpu_offload: bool = False) -> dict[str, Any]:
    """The sharded state dict of ``model``'s optimizer (an accelerate wrapper is unwrapped); an
    optimizer that has not stepped yet gets its state initialised, a template for loads."""
    return get_optimizer_state_dict(model, _inner(optimizer), options=StateDictOptions(cpu_offload=cpu_offload))


def set_model_state(model: Any, state: dict[str, Any]) -> None:
    """Hand a loaded (CPU) state dict back to an FSDP2 model."""
    set_model_state_dict(model, state, options=StateDictOptions(cpu_offload=True))


def set_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Hand a loaded (CPU) state dict back to ``model``'s optimizer."""
    set_optimizer_state_dict(model, _inner(optimizer), state, options=StateDictOptions(cpu_offload=True))


def _inner(optimizer: Any) -> Any:
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
