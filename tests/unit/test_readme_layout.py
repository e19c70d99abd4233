"""README's layout block names every module of the package, and nothing that is not there."""

from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PKG = os.path.join(ROOT, "src", "fastpersist")


def listed(readme: str) -> tuple[set[str], set[str]]:
    """The modules and folders README's block under ``src/fastpersist/`` names, as paths
    relative to the package (nesting by two spaces of indentation)."""
    lines = readme.split("\n")
    start = lines.index("src/fastpersist/")
    files: set[str] = set()
    folders: set[str] = set()
    stack: list[str] = []
    for line in lines[start + 1:]:
        indent = len(line) - len(line.lstrip(" "))
        if indent < 2 or not line.strip() or line.startswith("```"):
            break
        level = indent // 2 - 1
        name = line.split()[0]
        stack = stack[:level]
        path = "/".join([*stack, name.rstrip("/")])
        if name.endswith("/"):
            folders.add(path)
            stack.append(name.rstrip("/"))
        else:
            files.add(path)
    return files, folders


def present() -> tuple[set[str], set[str]]:
    files, folders = set(), set()
    for d, _, names in os.walk(PKG):
        rel = os.path.relpath(d, PKG).replace(os.sep, "/")
        if rel != "." and "__pycache__" not in rel:
            folders.add(rel)
        for n in names:
            if n.endswith(".py") and (n != "__init__.py" or rel == "."):
                files.add(n if rel == "." else f"{rel}/{n}")
    return files, folders


def test_readme_layout_matches_the_tree():
    with open(os.path.join(ROOT, "README.md")) as f:
        files, folders = listed(f.read())
    have_files, have_folders = present()
    assert not have_files - files, f"modules README's layout does not name: {sorted(have_files - files)}"
    assert not files - have_files, f"README's layout names modules that do not exist: {sorted(files - have_files)}"
    assert folders == have_folders, f"folders differ: README {sorted(folders ^ have_folders)}"


def test_the_parser_reads_nesting():
    block = "x\n```\nsrc/fastpersist/\n  a.py  one\n  b/    two\n    c.py three\n    d/\n      e.py\n  f.py\nend/\n```"
    assert listed(block) == ({"a.py", "b/c.py", "b/d/e.py", "f.py"}, {"b", "b/d"})
