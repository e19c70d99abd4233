"""From live training objects to a saveable state and back.

Objects with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers, LR schedulers,
GradScaler, anything stateful) are saved through ``state_dict()`` and restored in place through
``load_state_dict()``. Plain dicts are walked; everything else is saved as it is.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

from fastpersist.errors import CheckpointReadError


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def to_saveable(obj: Any) -> Any:
    """``obj`` with every stateful object replaced by its ``state_dict()``."""
    if is_stateful(obj):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return {k: to_saveable(v) for k, v in obj.items()}
    return obj


def restore_into(loaded: Any, into: Mapping[str, Any], where: str) -> None:
    """Load ``loaded[key]`` into each ``into[key]``, in place.

    Stateful objects get ``load_state_dict``; mutable mappings are updated recursively (their
    stateful values restored in place, other values replaced).
    """
    if not isinstance(loaded, Mapping):
        raise CheckpointReadError(f"{where}: the checkpoint holds a {type(loaded).__name__}, not a dict to load into")
    for key, target in into.items():
        if key not in loaded:
            raise CheckpointReadError(f"{where}: the checkpoint has no entry {key!r} (it has {sorted(map(str, loaded))})")
        value = loaded[key]
        if is_stateful(target):
            target.load_state_dict(value)
        elif isinstance(target, MutableMapping):
            if not isinstance(value, Mapping):
                raise CheckpointReadError(f"{where}: entry {key!r} is a {type(value).__name__}, not a dict")
            for k, v in value.items():
                inner = target.get(k)
                if is_stateful(inner) or (isinstance(inner, MutableMapping) and isinstance(v, Mapping)):
                    restore_into({k: v}, {k: inner}, where)
                else:
                    target[k] = v
        else:
            raise CheckpointReadError(
                f"{where}: cannot load entry {key!r} in place into a {type(target).__name__}; pass "
                "objects with load_state_dict() or dicts in `into`, or read the returned state"
            )
