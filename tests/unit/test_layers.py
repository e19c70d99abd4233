"""The package's layers: every import points down (or stays inside its layer), and no two
modules import each other, directly or through others. Every import counts, also one inside a
function or under ``TYPE_CHECKING``: a cycle there still hides which module is the lower one."""

from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "src", "fastpersist")

# Lowest first. A module belongs to the first entry that is its name or a package above it;
# it may import modules of its own layer and of the layers before it, never one after.
LAYERS: list[tuple[str, ...]] = [
    ("errors",),
    ("torch_internals", "config", "plan", "timeline", "options", "state", "teardown", "dist"),
    ("format", "topology"),
    ("io",),
    ("storage",),
    ("objects",),
    ("loading",),
    ("saving",),
    ("tiers",),
    ("checkpointer", "dcp", "single_file", "faults", "__main__", "save_process"),
    ("integrations", "cli"),
]


def modules() -> dict[str, str]:
    """Every module of the package: dotted name (without ``fastpersist.``) -> file."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), PKG)[:-3].replace(os.sep, ".")
                if rel == "__init__":
                    continue  # the package itself exports the public names of every layer
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = os.path.join(d, f)
    return out


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"fastpersist.{module} is in no layer: add it to LAYERS (and to docs/DESIGN.md)")


def imports(module: str, path: str, known: dict[str, str]) -> set[str]:
    """The package's modules that ``module`` imports (a name imported from a package counts as
    its submodule when it is one, else as the package)."""
    out = set()
    package = module.split(".")[:-1] if not path.endswith("__init__.py") else module.split(".")
    for node in ast.walk(ast.parse(open(path).read(), path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                src = ".".join(["fastpersist", *base] + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            names = [src] + [f"{src}.{a.name}" for a in node.names]
        for n in names:
            if n != "fastpersist" and not n.startswith("fastpersist."):
                continue
            parts = n.split(".")[1:]
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts and ".".join(parts) != module:
                out.add(".".join(parts))
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def test_every_module_has_a_layer():
    found = modules()
    assert len(found) > 50 and "saving.protocol" in found, f"the package was not found under {PKG}"
    for m in found:
        layer(m)


def test_imports_point_down():
    upward = sorted(f"fastpersist.{m} (layer {layer(m)}) imports fastpersist.{t} (layer {layer(t)})"
                    for m, targets in graph().items() for t in targets
                    if layer(t) > layer(m) and not modules()[t].endswith("__init__.py"))
    assert not upward, "imports that point up a layer:\n" + "\n".join(upward)


def _cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    # a package's __init__ that only exports names is not a module of the cycle
    g = {m: {t for t in ts if not modules()[t].endswith("__init__.py")} for m, ts in graph().items()}
    cycles = _cycles(g)
    assert not cycles, "modules that import each other:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_look_for():
    """The checks themselves can fail: a made-up cycle and a made-up upward import are found."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer("storage.catalog") < layer("saving.protocol") < layer("tiers.durable.drain")


def test_the_save_core_knows_no_extension():
    """The protocol and its parts call extensions through saving/extension.py only: a new
    extension is a new module plus one line where the Checkpointer registers it."""
    g = graph()
    core = [m for m in g if m.startswith("saving.") and not m.startswith("saving.extensions")]
    assert "saving.protocol" in core
    leaks = sorted(f"fastpersist.{m} imports fastpersist.{t}" for m in core for t in g[m]
                   if t.startswith("saving.extensions.") or t.startswith("tiers."))
    assert not leaks, "the save core imports an extension:\n" + "\n".join(leaks)
