"""Strict JSON for fastpersist's own records (manifest, checksum record). Pure: no I/O.

The standard parser accepts what a damaged or hostile record may hold and what later code
cannot use: ``NaN``/``Infinity``, numbers like ``1e400`` (infinite) or 10^400 (an integer no
offset can be), nesting deep enough to exhaust the stack (``RecursionError``), and repeated keys (the last one
silently wins). :func:`loads` refuses all of them with a :class:`CorruptCheckpointError`
naming the file, so every value that comes out is finite and every integer fits in 63 bits.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastpersist.errors import CorruptCheckpointError

MAX_INT = (1 << 63) - 1


class _Invalid(ValueError):
    pass


def _constant(name: str) -> Any:
    raise _Invalid(f"{name} is not a number fastpersist accepts")


def _int(text: str) -> int:
    if len(text.lstrip("-")) > 19:
        raise _Invalid(f"integer {text[:24]}... is out of range")
    v = int(text)
    if abs(v) > MAX_INT:
        raise _Invalid(f"integer {text} is out of range")
    return v


def _float(text: str) -> float:
    v = float(text[:400])
    if not math.isfinite(v):
        raise _Invalid(f"number {text[:24]} is out of range")
    return v


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Invalid(f"key {k[:40]!r} appears twice in one object")
        out[k] = v
    return out


def loads(path: str, raw: bytes, what: str) -> Any:
    """Parse ``raw`` strictly; ``path`` and ``what`` (e.g. "manifest") are for the message."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_constant, parse_int=_int,
                          parse_float=_float, object_pairs_hook=_pairs)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{path}: the {what} is not valid JSON ({e})") from e
