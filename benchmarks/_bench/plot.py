"""The demo's picture (benchmarks/demo.py): per model, the iteration times of every contender and
the time training was blocked per save.

matplotlib is optional (the ``plot`` extra): this module imports it when it draws, so importing
the module costs nothing, and a missing matplotlib raises ``ModuleNotFoundError`` from
:func:`write_plot` (its ``name`` starts with ``matplotlib``) for the caller to report.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Panel:
    """One model's row of the picture. Values are milliseconds, keyed by contender label in the
    order they are drawn; the first entry of ``iterations`` is the baseline (no checkpoint)."""

    name: str
    iterations: dict[str, list[float]]  # every measured iteration
    blocked: dict[str, list[float]]  # every measured save


def write_plot(path: str, title: str, panels: Sequence[Panel]) -> None:
    """Draw one row per panel (iteration times left, blocked per save right) into ``path`` (PNG)."""
    from matplotlib.figure import Figure  # type: ignore[import-not-found]
    from matplotlib.ticker import FuncFormatter  # type: ignore[import-not-found]

    fig = Figure(figsize=(14, 1.2 + 4.2 * len(panels)), layout="constrained")
    fig.suptitle(title, fontsize=10)
    axes = fig.subplots(len(panels), 2, squeeze=False)
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    sparse = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:e}"[0] in "25" else "")  # 2, 5, 20, 50, ...
    for (left, right), panel in zip(axes, panels):
        colors = {name: f"C{i}" for i, name in enumerate(panel.iterations)}  # a contender's colour everywhere
        baseline = next(iter(panel.iterations.values()), [])
        _strip_box(left, panel.iterations, colors)
        if baseline:
            left.axhline(statistics.median(baseline), color="grey", linestyle="--", linewidth=0.8,
                         label="median without checkpoint")
            left.legend(loc="upper left", fontsize=8)
        left.set_ylabel("iteration time (ms)")
        left.set_title(f"{panel.name}: iteration time, every measured iteration", fontsize=10)
        _strip_box(right, panel.blocked, colors)
        right.set_yscale("log")
        right.yaxis.set_major_formatter(plain)
        right.yaxis.set_minor_formatter(sparse)
        right.tick_params(axis="y", which="minor", labelsize=7)
        right.set_ylabel("training blocked per save (ms, log)")
        right.set_title(f"{panel.name}: time training was blocked by each save", fontsize=10)
    fig.savefig(path, dpi=110)


def _strip_box(ax: Any, series: dict[str, list[float]], colors: dict[str, str]) -> None:
    """Box plot (median, quartiles, 1.5 IQR whiskers) with every sample drawn over it, jittered."""
    names = [n for n, xs in series.items() if xs]
    positions = list(range(1, len(names) + 1))
    if not names:
        return
    ax.boxplot([series[n] for n in names], positions=positions, widths=0.5, showfliers=False,
               medianprops={"color": "black"})
    jitter = random.Random(0)
    for pos, name in zip(positions, names):
        xs = [pos + jitter.uniform(-0.18, 0.18) for _ in series[name]]
        ax.scatter(xs, series[name], s=9, alpha=0.5, zorder=3, color=colors.get(name, "black"))
    ax.set_xticks(positions, [n.replace(" ", "\n", 1) for n in names], fontsize=8)
    ax.grid(axis="y", alpha=0.3)
