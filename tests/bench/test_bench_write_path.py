"""benchmarks/bench_write_path.py runs end to end on a tiny state: every contender asked for is
measured in a process of its own and gets its row, and the run leaves nothing in --dir."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO


def test_write_path_benchmark_prints_a_row_per_contender(tmp_path):
    run = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "bench_write_path.py"), "--gib", "0.01", "--rounds", "1",
         "--settle", "0", "--dir", str(tmp_path), "--only", "single,single-staged,single-zc,sync,layout,process"],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    rows = {line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "---" not in line}
    assert {"raw", "single", "single-staged", "single-zc", "sync", "layout", "process"} <= rows, out
    assert os.listdir(tmp_path) == []
