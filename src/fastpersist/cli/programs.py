"""``fastpersist demo`` and ``fastpersist bench``: the programs of a source checkout's benchmarks/.

The demo and the benchmarks are not part of the installed package (they train models, kill
processes and measure disks; the library needs none of it). In a checkout, these commands run
``benchmarks/demo.py`` and ``benchmarks/bench_single_file.py`` in this process, with the
arguments given; an installed package without its checkout says where they are and exits 2.
"""

from __future__ import annotations

import importlib.util
import os
import sys

# src/fastpersist/cli/programs.py -> the checkout's root holds benchmarks/ beside src/
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BENCHMARKS = os.path.join(_ROOT, "benchmarks")


def _run(command: str, program: str, argv: list[str]) -> int:
    """Import ``benchmarks/<program>`` (benchmarks/ put on the path, for its ``_bench`` imports)
    and return its ``main(argv)``."""
    path = os.path.join(BENCHMARKS, program)
    if not (os.path.isfile(path) and os.path.isdir(os.path.join(BENCHMARKS, "_bench"))):
        print(f"fastpersist {command}: the demo and the benchmarks run from a source checkout of fastpersist "
              "(bash scripts/demo.sh, bash scripts/bench.sh); this installation has none", file=sys.stderr)
        return 2
    if BENCHMARKS not in sys.path:
        sys.path.insert(0, BENCHMARKS)
    name = "_fastpersist_" + os.path.splitext(program)[0]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:  # pragma: no cover - a .py file always has a loader
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return int(module.main(argv))


def demo_main(argv: list[str]) -> int:
    return _run("demo", "demo.py", argv)


def bench_main(argv: list[str]) -> int:
    return _run("bench", "bench_single_file.py", argv)
