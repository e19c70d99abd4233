"""benchmarks/bench_engine.py runs end to end on the tests' tiny model: a row per contender asked
for, with its overhead and blocked time, and the memory column from fresh processes."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO


def test_engine_benchmark_prints_a_row_per_contender(tmp_path):
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_engine.py"), "--size", "tiny", "--rounds", "2",
         "--block", "3", "--models", "gpt", "--only", "overlap+process,snapshot+process,overlap", "--memory",
         "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in run.stdout.splitlines()
            if line.startswith("| ") and "---" not in line and "contender" not in line}
    assert set(rows) == {"none", "overlap+process", "snapshot+process", "overlap"}, run.stdout
    assert all(rows[c].count("|") == 6 and rows[c].rstrip(" |").split("|")[-1].strip() != "-"
               for c in ("overlap+process", "snapshot+process", "overlap")), run.stdout
    assert os.listdir(tmp_path) == []
