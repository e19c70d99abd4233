"""Every use fastpersist makes of torch's private serialization internals, in one place.

fastpersist writes torch's own archive format with torch's own pickler, and reads it back with
torch's own loader, so its files stay byte-compatible with ``torch.save``/``torch.load``. That
needs a few private entry points of ``torch.serialization``; they are reached only through this
module, which checks on first use that they exist with the signatures fastpersist was tested
with (torch 2.13, as ``pyproject.toml`` declares), and otherwise raises one clear error instead
of a confusing failure deep inside a save.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch

from fastpersist.errors import UnsupportedTorchError

TESTED = "2.13"

# name in torch.serialization -> parameters fastpersist passes
_EXPECTED = {
    "_save": ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"),
    "_load": ("zip_file", "map_location", "pickle_module", "overall_storage"),
    "_get_storage_alignment": (),
}


@functools.cache
def check() -> None:
    """Raise :class:`UnsupportedTorchError` if torch lacks what fastpersist needs."""
    problems = []
    for name, params in _EXPECTED.items():
        fn = getattr(torch.serialization, name, None)
        if fn is None:
            problems.append(f"torch.serialization.{name} is missing")
            continue
        have = inspect.signature(fn).parameters
        missing = [p for p in params if p not in have]
        if missing:
            problems.append(f"torch.serialization.{name} lacks parameter(s) {missing}")
    if not hasattr(torch._C, "PyTorchFileWriter"):
        problems.append("torch._C.PyTorchFileWriter is missing")
    if getattr(torch, "_weights_only_unpickler", None) is None:
        problems.append("torch._weights_only_unpickler is missing")
    if problems:
        raise UnsupportedTorchError(
            f"fastpersist was tested with torch {TESTED}.x; torch {torch.__version__} differs where fastpersist "
            f"uses its serialization internals: {'; '.join(problems)}. Install a tested torch version"
        )


def file_writer(sink: Any, compute_crc32: bool, alignment: int) -> Any:
    """torch's zip writer (``torch._C.PyTorchFileWriter``) over ``sink``."""
    check()
    return torch._C.PyTorchFileWriter(sink, compute_crc32, alignment)  # type: ignore[call-overload]


def save_records(obj: object, writer: Any, pickle_module: Any, protocol: int) -> None:
    """``torch.serialization._save``: pickle ``obj`` and its storages into ``writer``."""
    check()
    torch.serialization._save(obj, writer, pickle_module, protocol, False)


def load_records(archive: Any, map_location: Any, pickle_module: Any, overall_storage: torch.UntypedStorage | None) -> Any:
    """``torch.serialization._load`` over an archive view whose storages are slices of
    ``overall_storage`` (no copy)."""
    check()
    return torch.serialization._load(archive, map_location, pickle_module, overall_storage=overall_storage,
                                     encoding="utf-8")


def storage_alignment() -> int:
    check()
    return int(torch.serialization._get_storage_alignment())


def weights_only_unpickler() -> Any:
    """torch's restricted unpickler module (refuses code execution)."""
    check()
    return torch._weights_only_unpickler


def copy_many(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for each pair, in one call that holds the GIL once (``_foreach_copy_``;
    pair by pair where torch lacks it)."""
    many = getattr(torch, "_foreach_copy_", None)
    if many is not None:
        many(dsts, srcs)
        return
    for d, s in zip(dsts, srcs):  # pragma: no cover - every tested torch has _foreach_copy_
        d.copy_(s)
