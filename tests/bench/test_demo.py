"""The demo (benchmarks/demo.py, ``fastpersist demo``) part 1: the interleaved measurement, its
statistics, its table and its picture.

Part 2 (crash and resume) is tested by tests/test_bench_crash.py.
"""

from __future__ import annotations

import random
import re
import sys

import pytest

import bench_path  # noqa: F401  (benchmarks/ on sys.path)
import demo
from _bench.stats import overhead, quantile

TINY = ["--size", "tiny", "--rounds", "2", "--warmup", "1", "--block", "3", "--skip-crash"]
LABELS = [demo.label(m) for m in demo.CONTENDERS]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ the statistics, on made-up samples


def _rounds(n: int, seed: int, mean: float = 100.0, sd: float = 3.0) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, sd) for _ in range(n)]


def test_a_real_overhead_is_reported_with_its_interval():
    """10% slower in every round, with round-to-round drift larger than the difference: pairing by
    round must still see it, and the interval must exclude 0."""
    base = [b * drift for b, drift in zip(_rounds(12, 1), [1.0, 1.3, 0.8, 1.1, 0.9, 1.2] * 2)]
    other = [b * 1.10 * (1 + e) for b, e in zip(base, _rounds(12, 2, mean=0.0, sd=0.01))]
    o = overhead(base, other)
    assert not o.within_noise
    assert 0.08 < o.low <= o.estimate <= o.high < 0.12
    assert re.fullmatch(r"\+\d+\.\d% \(95% CI \+\d+\.\d% to \+\d+\.\d%\)", str(o)), str(o)


def test_a_real_speedup_is_negative_and_not_noise():
    base = _rounds(10, 3)
    o = overhead(base, [b * 0.9 for b in base])
    assert not o.within_noise and str(o).startswith("-10.0%")


def test_a_difference_inside_the_noise_says_so():
    """Two draws from one distribution: the interval holds 0, and no bare signed percentage is shown."""
    o = overhead(_rounds(10, 4), _rounds(10, 5))
    assert o.low < 0 < o.high and o.within_noise
    assert str(o).startswith("within noise (95% CI -")


def test_the_interval_is_reproducible_and_needs_paired_rounds():
    base, other = _rounds(8, 6), _rounds(8, 7)
    assert overhead(base, other) == overhead(base, other)
    with pytest.raises(ValueError, match="paired rounds"):
        overhead(base, other[:-1])
    with pytest.raises(ValueError):
        overhead([], [])


def test_quantile_and_rotation():
    assert [quantile([4.0, 1.0, 3.0, 2.0], q) for q in (0, 0.25, 0.5, 1)] == [1.0, 1.75, 2.5, 4.0]
    assert quantile([7.0], 0.9) == 7.0
    orders = [demo.rotated(demo.CONTENDERS, r) for r in range(len(demo.CONTENDERS))]
    for position in range(len(demo.CONTENDERS)):  # every contender runs once in every position
        assert sorted(o[position] for o in orders) == sorted(demo.CONTENDERS)


# ------------------------------------------------------------------ the measurement, tiny models


def test_measure_pairs_rounds_and_counts_the_saves(tmp_path):
    r = demo.measure("gpt", demo.SIZES["tiny"], rounds=3, warmup=1, block=3, workdir=str(tmp_path))
    assert set(r.samples) == set(demo.CONTENDERS)
    for mode, s in r.samples.items():
        assert [len(x) for x in s.rounds] == [3, 3, 3]  # warm-up round dropped, untimed iteration dropped
        assert all(t > 0 for t in s.times)
        # every measured save but each block's last (its wait for the next step is not in the block)
        assert len(s.blocked) == (0 if mode == "none" else 3 * 2)
        assert len(s.write) == (3 * 2 if mode in ("sync", "snapshot", "overlap", "overlap+process") else 0)
    assert r.samples["snapshot"].arena > 0 and min(r.samples["snapshot"].copied) > 0
    assert r.params > 0 and r.state_bytes > 0
    # every contender's checkpoints went to its own place; keep=2 held
    for mode in ("sync", "snapshot", "overlap", "overlap+process"):
        assert len([p for p in (tmp_path / f"gpt-{mode}").iterdir() if p.name.startswith("step-")]) == 2


def _tables(out: str) -> dict[str, list[list[str]]]:
    """The demo's markdown tables, by model: rows of cells (header and rule left out)."""
    tables: dict[str, list[list[str]]] = {}
    kind = None
    for line in out.splitlines():
        m = re.match(r"## (\w+):", line)
        if m:
            kind = m.group(1)
            tables[kind] = []
        elif kind and line.startswith("| ") and not line.startswith("| checkpoint every"):
            tables[kind].append([c.strip() for c in line.strip("|").split("|")])
    return tables


def test_demo_prints_every_contender_with_median_spread_and_interval(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert demo.main([*TINY, "--no-plot", "--quiet"]) == 0
    captured = capsys.readouterr()
    tables = _tables(captured.out)
    assert sorted(tables) == ["gpt", "moe"]
    for rows in tables.values():
        assert [row[0] for row in rows] == LABELS
        for row in rows:
            assert re.fullmatch(r"\d+\.\d \[\d+\.\d-\d+\.\d\]", row[1]), row  # median [IQR]
            q1, q3 = map(float, re.findall(r"[\d.]+", row[1])[1:])
            assert q1 <= float(row[1].split()[0]) <= q3
        assert rows[0][2] == "-" and rows[0][3] == "-"  # the baseline
        for row in rows[1:]:
            assert re.fullmatch(r"(within noise|[+-]\d+\.\d%) \(95% CI [+-]\d+\.\d% to [+-]\d+\.\d%\)", row[2]), row
            assert re.fullmatch(r"\d+\.\d / \d+\.\d", row[3]), row  # blocked per save: median / p90
    assert "picture" not in captured.out and not list(tmp_path.glob("*.png"))  # --no-plot
    assert captured.err == ""  # no progress when stderr is not a terminal


def test_plot_writes_a_png(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "out" / "demo.png"
    target.parent.mkdir()
    assert demo.main([*TINY, "--plot", str(target), "--quiet"]) == 0
    data = target.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 800 and height > 600
    assert f"picture: {target}" in capsys.readouterr().out
    assert not list(tmp_path.glob("*.png"))  # only where it was asked for


def test_without_matplotlib_the_table_is_still_printed(tmp_path, monkeypatch, capsys):
    """The plot extra is optional: the demo says how to install it and prints its table; the
    default picture is skipped quietly (exit 0), an explicit --plot fails (exit 1)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ModuleNotFoundError
    assert demo.main([*TINY, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert sorted(_tables(out)) == ["gpt", "moe"]
    assert "pip install 'fastpersist[plot]'" in out
    assert not list(tmp_path.glob("*.png"))
    assert demo.main([*TINY, "--quiet", "--plot", str(tmp_path / "x.png")]) == 1


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        demo.main(["--block", "1"])
