"""One storage seam: every file operation on checkpoint data goes through
:class:`fastpersist.storage.backend.FileBackend` (so a fault backend reaches it).

The test walks the package's sources with ``ast`` and names ``file:line`` of every call of a raw
file operation (``os.open``, ``os.pwrite``, ``shutil.rmtree``, the I/O engine's ``fsync_dir``,
builtin ``open``, ...) outside the modules allowed to do raw I/O, and of every existence query
(``os.path.isdir``, ...) outside its own short allowlist. Calls are resolved through each
module's imports (``import os as _os``, ``from os import pwrite``, ``from fastpersist.io.files
import fsync_dir``); a method of an object (``self.backend.fsync_dir``, ``file.read_exact``) is
the seam itself and never counts. A second test plants calls in a scratch module and checks
that the walker finds each of them, so that this test can fail."""

from __future__ import annotations

import ast
import os
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
PKG = os.path.join(ROOT, "src", "fastpersist")

_IO_FILES = "fastpersist.io.files"

# Operations that create, write, read, sync, rename, link, delete, list or stat a file.
RAW: frozenset[str] = frozenset({
    *(f"os.{op}" for op in ("open", "pwrite", "pwritev", "write", "fsync", "fdatasync", "lstat", "stat",
                            "ftruncate", "truncate", "pread", "preadv", "link", "symlink", "replace", "rename",
                            "renames", "unlink", "remove", "removedirs", "rmdir", "makedirs", "mkdir", "listdir",
                            "scandir", "walk")),
    "shutil.rmtree", "shutil.move", "shutil.copy", "shutil.copy2", "shutil.copyfile", "shutil.copytree",
    "tempfile.mkdtemp", "tempfile.mkstemp", "tempfile.NamedTemporaryFile", "tempfile.TemporaryDirectory",
    "builtins.open", "io.open",
    # the I/O engine's helpers that act on a path or a raw descriptor (fastpersist/io/files.py)
    *(f"{_IO_FILES}.{fn}" for fn in ("fsync_dir", "pwrite_all", "pread_into", "read_exact", "read_small_file",
                                     "open_regular")),
})

# Queries of what a path is (they change nothing, but a fault backend may want to fail them).
QUERIES: frozenset[str] = frozenset(f"os.path.{q}" for q in ("exists", "lexists", "isdir", "isfile", "islink",
                                                            "getsize", "getmtime"))

# Modules that may do raw file I/O (paths relative to src/fastpersist; a folder ends with /).
ALLOWED_MODULES: dict[str, str] = {
    "io/": "the I/O engine under the backend (aligned buffers, O_DIRECT files, writer and reader)",
    "storage/backend.py": "the seam itself",
    "teardown.py": "reads /proc/self/task to find the threads left at exit, not files of a checkpoint",
    "cli/": "the command line: opens /dev/null, prints, checks the paths a user typed",
}

# Raw operations allowed elsewhere: (module, operation) -> why.
ALLOWED_CALLS: dict[tuple[str, str], str] = {
    ("storage/roots.py", "os.stat"):
        "the roots' (device, inode) identity, checked while a Checkpointer is built, before any file is "
        "opened or created and before the backend is in use (see the module's docstring)",
    ("format/torchzip.py", "os.pread"):
        "read_directory(path, fd) for a descriptor the caller opened (tests and tools); fastpersist's own "
        "loads pass the backend file's read_exact instead",
}

# Existence queries allowed outside ALLOWED_MODULES: (module, query) -> why.
ALLOWED_QUERIES: dict[tuple[str, str], str] = {
    ("storage/roots.py", "os.path.lexists"): "root checks at construction (see storage/roots.py)",
    ("storage/roots.py", "os.path.isdir"): "root checks at construction (see storage/roots.py)",
    ("storage/roots.py", "os.path.isfile"): "root checks at construction (see storage/roots.py)",
}


def _dotted(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ["a", "b", "c"]; None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return parts[::-1]


def _aliases(tree: ast.Module, module: str) -> dict[str, str]:
    """Local name -> what it names, from every import of the module (those inside functions too)."""
    out: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname is not None:
                    out[a.asname] = a.name
                else:
                    head = a.name.split(".")[0]
                    out[head] = head
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")
                pkg = pkg[: len(pkg) - node.level]
                base = ".".join(pkg + ([base] if base else []))
            for a in node.names:
                out[a.asname or a.name] = f"{base}.{a.name}" if base else a.name
    return out


def _module_level_names(tree: ast.Module) -> set[str]:
    """Names the module itself binds at its top level (a ``def open`` shadows the builtin)."""
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def calls(source: str, filename: str, module: str) -> Iterator[tuple[int, str]]:
    """(line, fully qualified callee) of every call in ``source`` whose callee the module's
    imports resolve (``os.open``, ``fastpersist.io.files.fsync_dir``, ``builtins.open``)."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree, module)
    shadowed = _module_level_names(tree)
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        parts = _dotted(node.func)
        if parts is None:
            continue
        head = parts[0]
        if head in aliases:
            yield node.lineno, ".".join([aliases[head], *parts[1:]])
        elif parts == ["open"] and "open" not in shadowed:
            yield node.lineno, "builtins.open"


def _sources() -> Iterator[tuple[str, str]]:
    """(path relative to src/fastpersist, file) of every module of the package."""
    for d, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, PKG).replace(os.sep, "/"), path


def _module_name(rel: str) -> str:
    """The dotted name relative imports resolve from (a package's ``__init__`` kept: ``from .``
    in ``fastpersist/storage/__init__.py`` is ``fastpersist.storage``)."""
    return "fastpersist." + rel[: -len(".py")].replace("/", ".")


def _allowed_module(rel: str) -> bool:
    return any(rel == m or (m.endswith("/") and rel.startswith(m)) for m in ALLOWED_MODULES)


def escapes(rel: str, source: str, ops: frozenset[str], allowed: dict[tuple[str, str], str]) -> list[str]:
    """``file:line: callee`` of each call of ``ops`` in the module ``rel`` that is not allowed."""
    if _allowed_module(rel):
        return []
    return [f"src/fastpersist/{rel}:{line}: {callee}"
            for line, callee in sorted(calls(source, rel, _module_name(rel)))
            if callee in ops and (rel, callee) not in allowed]


def _scan(ops: frozenset[str], allowed: dict[tuple[str, str], str]) -> list[str]:
    found: list[str] = []
    for rel, path in _sources():
        with open(path, encoding="utf-8") as f:
            found += escapes(rel, f.read(), ops, allowed)
    return found


def test_every_file_operation_goes_through_the_backend() -> None:
    """No module outside io/, storage/backend.py, teardown.py and cli/ calls a raw file
    operation (see RAW) except the few ALLOWED_CALLS, each with its reason."""
    found = _scan(RAW, ALLOWED_CALLS)
    assert not found, ("file operations outside the FileBackend (route them through "
                       "fastpersist.storage.backend.FileBackend, or allow them here with a reason):\n"
                       + "\n".join(found))


def test_existence_queries_go_through_the_backend() -> None:
    """``os.path.isdir``/``lexists``/... on checkpoint paths go through the backend's
    ``exists``/``is_dir``/``stat`` too, except the few ALLOWED_QUERIES."""
    found = _scan(QUERIES, ALLOWED_QUERIES)
    assert not found, "queries outside the FileBackend:\n" + "\n".join(found)


def test_every_allowance_is_still_needed() -> None:
    """An allowance whose call is gone is removed (the list says what is left, nothing more)."""
    seen: set[tuple[str, str]] = set()
    for rel, path in _sources():
        with open(path, encoding="utf-8") as f:
            seen |= {(rel, callee) for _, callee in calls(f.read(), rel, _module_name(rel))}
    stale = [k for k in [*ALLOWED_CALLS, *ALLOWED_QUERIES] if k not in seen]
    assert not stale, f"allowances no call needs any more: {stale}"
    for d in ALLOWED_MODULES:
        assert os.path.exists(os.path.join(PKG, d)), d


_PLANTED = '''
import os as _os
import shutil
from os import pwrite
from fastpersist.io.files import fsync_dir
from fastpersist.io import files as iofiles
from ..io.files import pread_into

def save(path, fd, backend, file):
    fd = _os.open(path, _os.O_WRONLY)           # 10
    pwrite(fd, b"x", 0)                          # 11
    fsync_dir("/tmp")                            # 12
    shutil.rmtree(path)                          # 13
    with open(path, "rb") as f:                  # 14
        f.read()
    iofiles.pwrite_all(fd, memoryview(b""), 0)   # 16
    pread_into(fd, memoryview(bytearray(1)), 0)  # 17
    _os.path.isdir(path)                         # 18
    backend.fsync_dir("/tmp")                    # the seam: not counted
    file.read_exact(0, 1)                        # a method: not counted
    backend.open(path, 0, "off", 0)              # the seam: not counted
'''


def test_the_walker_finds_planted_calls() -> None:
    """The walker itself can fail: every raw call planted in a module is named with its line,
    however it was imported; calls through the backend and methods of objects are not."""
    rel = "storage/planted.py"
    want = {10: "os.open", 11: "os.pwrite", 12: "fsync_dir", 13: "shutil.rmtree", 14: "builtins.open",
            16: "pwrite_all", 17: "pread_into"}
    qualified = {line: callee if "." in callee else f"{_IO_FILES}.{callee}" for line, callee in want.items()}
    assert escapes(rel, _PLANTED, RAW, ALLOWED_CALLS) == [f"src/fastpersist/{rel}:{line}: {callee}"
                                                         for line, callee in sorted(qualified.items())]
    assert escapes(rel, _PLANTED, QUERIES, ALLOWED_QUERIES) == [f"src/fastpersist/{rel}:18: os.path.isdir"]
    # an allowed module, and an allowed call, are not reported; the same call elsewhere is
    assert escapes("io/planted.py", _PLANTED, RAW, ALLOWED_CALLS) == []
    assert escapes("storage/roots.py", "import os\nos.stat('/')\n", RAW, ALLOWED_CALLS) == []
    assert escapes("storage/catalog.py", "import os\nos.stat('/')\n", RAW, ALLOWED_CALLS) == [
        "src/fastpersist/storage/catalog.py:2: os.stat"]
    # a module that defines its own ``open`` calls it, not the builtin
    assert escapes("tiers/x.py", "def open(p):\n    return p\nopen('a')\n", RAW, ALLOWED_CALLS) == []
    # a relative import resolves from the module's own package (here: fastpersist.tiers.io, no engine)
    assert escapes("tiers/nodes/x.py", "from ..io.files import fsync_dir\nfsync_dir('/')\n", RAW,
                   ALLOWED_CALLS) == []
    assert escapes("tiers/nodes/x.py", "from ...io.files import fsync_dir\nfsync_dir('/')\n", RAW,
                   ALLOWED_CALLS) == [f"src/fastpersist/tiers/nodes/x.py:2: {_IO_FILES}.fsync_dir"]
