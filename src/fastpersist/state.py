"""From live training objects to a saveable state and back.

Objects with ``state_dict()`` / ``load_state_dict()`` (modules, optimizers, LR schedulers,
GradScaler, anything stateful) are saved through ``state_dict()`` and restored in place through
``load_state_dict()``. Plain dicts are walked; everything else is saved as it is.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

from fastpersist.errors import CheckpointReadError

logger = logging.getLogger(__name__)


def is_stateful(obj: object) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def to_saveable(obj: Any) -> Any:
    """``obj`` with every stateful object replaced by its ``state_dict()``.

    A ``dict`` or ``OrderedDict`` is rebuilt only where a stateful object inside it was replaced
    (an OrderedDict keeping its attributes, as a module's state_dict keeps ``_metadata``); one
    without any is saved as it is. Other mappings (``defaultdict``, ``MappingProxyType``, a
    custom Mapping) are saved as dicts: their factories and types often cannot be pickled or
    are refused by the weights-only loader."""
    if is_stateful(obj):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        items = [(k, v, to_saveable(v)) for k, v in obj.items()]
        exact = type(obj) is dict or type(obj) is OrderedDict
        if exact and all(new is old for _, old, new in items):
            return obj
        if type(obj) is OrderedDict:
            out: dict[Any, Any] = OrderedDict([(k, new) for k, _, new in items])
            vars(out).update(vars(obj))
            return out
        return {k: new for k, _, new in items}
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
        if _is_tensor(target):
            _copy_tensor(target, value, key, where)
        elif is_stateful(target):
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


def _is_tensor(obj: object) -> bool:
    import torch

    return isinstance(obj, torch.Tensor)


def _copy_tensor(target: Any, value: Any, key: object, where: str) -> None:
    """A tensor in ``into`` is loaded in place (a sharded tensor was already read into it)."""
    import torch

    if value is target:
        return
    if not isinstance(value, torch.Tensor) or value.shape != target.shape or value.dtype != target.dtype:
        what = f"a {value.dtype} tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else \
            f"a {type(value).__name__}"
        raise CheckpointReadError(f"{where}: entry {key!r} is {what}, the destination a {target.dtype} tensor of "
                                  f"shape {list(target.shape)}")
    with torch.no_grad():
        target.copy_(value)


class RNGState:
    """The random number generators of a process, as a stateful object.

    ``state_dict()`` captures torch's CPU generator, every CUDA device's generator (when CUDA
    is initialised), numpy's global generator (when numpy is installed) and Python's
    ``random``; ``load_state_dict()`` puts them back. Everything is stored as tensors and plain
    Python values, so torch's weights-only loader accepts it. RNG state differs per rank: save
    it in ``rank_state``. A state loaded with a ``map_location`` that put its tensors on a GPU
    is restored too (generator states are moved back to the host, where torch requires them).
    """

    def state_dict(self) -> dict[str, Any]:
        import random

        import torch

        version, internal, gauss = random.getstate()
        out: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # pragma: no cover - no GPU in CI
            out["cuda"] = torch.cuda.get_rng_state_all()
        np = _numpy()
        if np is not None:
            name, keys, pos, has_gauss, cached = np.random.get_state()
            out["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                            "has_gauss": int(has_gauss), "cached": float(cached)}
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        import random

        import torch

        torch.set_rng_state(state["torch"].cpu())
        py = state["python"]
        random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
        if "cuda" in state and torch.cuda.is_available():  # pragma: no cover - no GPU in CI (tests/unit/io/test_gpu.py)
            _set_cuda_states(state["cuda"])
        np = _numpy()
        if np is not None and "numpy" in state:
            s = state["numpy"]
            np.random.set_state((s["name"], s["keys"].cpu().numpy().astype("uint32"), s["pos"], s["has_gauss"],
                                 s["cached"]))


def _set_cuda_states(states: Sequence[Any]) -> None:  # pragma: no cover - no GPU in CI (tests/unit/io/test_gpu.py)
    """Restore one generator state per visible device, on the host (``set_rng_state`` refuses GPU
    tensors); a different device count than at save time restores the common ones and says so."""
    import torch

    count = torch.cuda.device_count()
    if len(states) != count:
        logger.warning("the RNG state holds %d CUDA generators, this process sees %d devices: "
                       "restoring the first %d", len(states), count, min(len(states), count))
    for i, s in enumerate(states[:count]):
        torch.cuda.set_rng_state(s.cpu(), i)


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:
        return None
    return numpy
