"""Copies of a checkpoint's bytes across nodes (manifest version 4). Pure: no I/O.

In a job that spans several nodes every extent may lie in several files, one per node (its
first location and its ``copies``). A reader uses one location per extent: :func:`localize`
rewrites a manifest so that every extent points at the location a chooser picked (the rest of
fastpersist's readers then read it like any one-node checkpoint), and names the extents no
location of which can be used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from fastpersist.format import manifest as mf

Location = tuple[int, int]  # (file index, offset in that file)


def extents(manifest: mf.Manifest) -> Iterator[tuple[str, mf.ExtentEntry]]:
    """Every extent of the checkpoint (skeletons included) with what it holds, in a fixed order."""
    for name, o in sorted(manifest.objects.items()):
        yield f"object {name!r} skeleton", o.skeleton
        for s in o.storages:
            for e in s.extents:
                yield f"object {name!r} storage {s.key!r}", e
    for t in manifest.sharded:
        for c in t.chunks:
            for e in c.extents:
                yield f"sharded tensor {t.key!r} chunk at {list(c.offsets)}", e


def map_extents(manifest: mf.Manifest, fn: Callable[[str, mf.ExtentEntry], mf.ExtentEntry]) -> mf.Manifest:
    """The manifest with every extent replaced by ``fn(what, extent)``."""
    objects = {}
    for name, o in manifest.objects.items():
        storages = tuple(dataclasses.replace(s, extents=tuple(fn(f"object {name!r} storage {s.key!r}", e)
                                                              for e in s.extents)) for s in o.storages)
        objects[name] = dataclasses.replace(o, skeleton=fn(f"object {name!r} skeleton", o.skeleton),
                                            storages=storages)
    sharded = tuple(dataclasses.replace(t, chunks=tuple(
        dataclasses.replace(c, extents=tuple(fn(f"sharded tensor {t.key!r} chunk at {list(c.offsets)}", e)
                                             for e in c.extents)) for c in t.chunks)) for t in manifest.sharded)
    return dataclasses.replace(manifest, objects=objects, sharded=sharded)


def localize(manifest: mf.Manifest, choose: Callable[[mf.ExtentEntry], Location | None]
             ) -> tuple[mf.Manifest, list[tuple[str, mf.ExtentEntry]]]:
    """The manifest with each extent at the location ``choose`` picks among
    ``extent.locations()`` (copies dropped), and the extents for which it picked none (they
    keep their first location). The file list is unchanged, so file indices stay valid."""
    missing: list[tuple[str, mf.ExtentEntry]] = []

    def pick(what: str, e: mf.ExtentEntry) -> mf.ExtentEntry:
        at = choose(e)
        if at is None:
            missing.append((what, e))
            at = (e.file, e.offset)
        return dataclasses.replace(e, file=at[0], offset=at[1], copies=())

    return map_extents(manifest, pick), missing


def describe_missing(manifest: mf.Manifest, missing: list[tuple[str, mf.ExtentEntry]], limit: int = 3) -> str:
    """``N extents (M bytes) of ...: what, in files ... (written on nodes ...)`` for messages."""
    total = sum(e.nbytes for _, e in missing)
    parts = []
    for what, e in missing[:limit]:
        where = ", ".join(f"{manifest.files[f].name} (node {node_name(manifest, manifest.files[f].node)})"
                          for f, _ in e.locations())
        parts.append(f"{what} bytes {e.start}..{e.start + e.nbytes} in {where}")
    more = f"; and {len(missing) - limit} more" if len(missing) > limit else ""
    return f"{len(missing)} extent{'s' if len(missing) != 1 else ''} ({total} bytes): {'; '.join(parts)}{more}"


def node_name(manifest: mf.Manifest, index: int) -> str:
    return manifest.nodes[index] if index < len(manifest.nodes) else f"#{index}"
