"""Puts the checkout's benchmarks/ on ``sys.path``, so that tests can import the demo and the
benchmarks (``_bench``, ``demo``, ``gpu_check``, ``bench_single_file``): they are programs of the
checkout, not part of the package. Import it before them: ``import bench_path  # noqa: F401``."""

from __future__ import annotations

import os
import sys

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")

if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
