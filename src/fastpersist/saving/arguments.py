"""The checks a Checkpointer's arguments and a save's arguments pass before anything is written."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

MODES = ("sync", "snapshot", "overlap")


def check_arguments(mode: str, max_in_flight: int, snapshot_bytes: int, history: int, timeout_s: float) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    positive_int("max_in_flight", max_in_flight)
    positive_int("snapshot_bytes", snapshot_bytes, minimum=0)
    positive_int("history", history)
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")


ENGINES = ("thread", "process")


def choose_engine(engine: str | None, backend: object) -> str:
    """The engine: ``engine``, checked; else ``FASTPERSIST_ENGINE`` (default ``thread``), where a
    ``backend`` given keeps the thread engine (the backend runs in this process)."""
    if engine is not None:
        check_engine(engine, backend)
        return engine
    chosen = os.environ.get("FASTPERSIST_ENGINE", "thread")
    if chosen not in ENGINES:
        raise ValueError(f"FASTPERSIST_ENGINE must be one of {ENGINES}, got {chosen!r}")
    return "thread" if backend is not None else chosen


def check_engine(engine: str, backend: object) -> None:
    """The process engine's limits, refused by name (docs/DESIGN.md, "The save process")."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine != "process":
        return
    if backend is not None:
        raise ValueError("engine='process' writes through the save process's own files: it does not take a backend "
                         "(fault injection runs with engine='thread')")


def positive_int(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def check_step(step: object) -> None:
    """Refuse a step that is not a non-negative integer (by name, before anything is written)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an integer, got {type(step).__name__} {step!r}")
    if step < 0:
        raise ValueError(f"step must be non-negative, got {step}")


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A JSON-safe copy of ``metadata``, checked before any byte is written."""
    if metadata is None:
        return None
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    bad_keys = [k for k in metadata if not isinstance(k, str)]
    if bad_keys:
        raise TypeError(f"metadata keys must be strings, got {bad_keys[0]!r}")
    try:
        text = json.dumps(dict(metadata), allow_nan=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        bad = next((k for k, v in metadata.items() if not _json_ok(v)), None)
        where = f" (key {bad!r})" if bad is not None else ""
        raise TypeError(f"metadata must hold JSON values (str keys; str, int, finite float, bool, None, lists, "
                        f"dicts){where}: {e}") from e
    return dict(json.loads(text))


def _json_ok(value: object) -> bool:
    try:
        json.dumps(value, allow_nan=False)  # refuses NaN and infinities too
    except (TypeError, ValueError):
        return False
    return True
