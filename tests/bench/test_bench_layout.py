"""Where the demo and the benchmarks live: outside the package, importing from it, never imported
by it, and their shared modules (benchmarks/_bench) without an import cycle."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "_bench")
# the order of benchmarks/_bench/__init__.py's list: a module imports only those before it
ORDER = ["stats", "plot", "measure", "state", "models", "savers", "crash_child", "crash", "deepspeed_writer"]


def _imports(path: str) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


def test_the_library_imports_nothing_from_the_benchmarks():
    for d, _, files in os.walk(os.path.join(ROOT, "src", "fastpersist")):
        for f in files:
            if f.endswith(".py"):
                found = {m for m in _imports(os.path.join(d, f))
                         if m.split(".")[0] in ("_bench", "benchmarks", "demo", "gpu_check", "bench_single_file")}
                assert not found, f"{os.path.join(d, f)} imports {found}"


def test_bench_modules_import_only_those_before_them():
    modules = sorted(f[:-3] for f in os.listdir(BENCH) if f.endswith(".py") and f != "__init__.py")
    assert modules == sorted(ORDER), "a module of _bench is missing from ORDER (and from __init__'s list)"
    for i, name in enumerate(ORDER):
        used = {m.split(".")[1] for m in _imports(os.path.join(BENCH, name + ".py")) if m.startswith("_bench.")}
        assert used <= set(ORDER[:i]), f"_bench.{name} imports {used - set(ORDER[:i])}, listed after it"
