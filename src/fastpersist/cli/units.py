"""How the command line writes sizes and rates: binary units (KiB, MiB, GiB; GiB/s).

The library's log lines use the same units. The benchmark tables (``fastpersist bench``,
benchmarks/, docs/BENCHMARKS.md) keep decimal GB/s, the unit of their recorded baselines.
"""

from __future__ import annotations

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size(nbytes: float) -> str:
    """``0 B``, ``1023 B``, ``1.0 KiB``, ``1.5 GiB``: bytes in binary units, one decimal."""
    n = float(nbytes)
    for unit in _UNITS:
        if abs(n) < 1024 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover - the loop returns at the last unit


def rate(nbytes: float, seconds: float) -> str:
    """A transfer rate in GiB/s (``-`` when no time passed)."""
    if seconds <= 0:
        return "- GiB/s"
    return f"{nbytes / seconds / 2**30:.2f} GiB/s"
