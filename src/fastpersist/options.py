"""The Checkpointer's options as objects: retention, the durable tier, the job's nodes.

Each is a small frozen dataclass a user builds once and may pass to several Checkpointers
(every rank passes equal ones), checked when it is built::

    ckpt = fastpersist.Checkpointer(
        roots, retention=fastpersist.Retention(keep=3, every=1000),
        durable=fastpersist.Durable("s3://bucket/run1", every=10, keep=5),
        nodes=fastpersist.Nodes(redundancy=2))

The Checkpointer's older keyword arguments are shorthands for them (``keep=3`` is
``retention=Retention(keep=3)``, ``durable_every=10`` is ``Durable(url, every=10)``, ``node=``
and ``redundancy=`` are ``Nodes(...)``); :func:`from_shorthands` turns them into options, and
refuses an option given both ways. The save's extensions are built from these objects.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from fastpersist.timeline import Commit, abandoned_steps, in_commit_order

ABANDONED_POLICIES = ("keep", "delete")


def _count(value: object, names: str, *, minimum: int = 1, optional: bool = True) -> None:
    """Refuse a value that is not an int >= ``minimum`` (or None where ``optional``)."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{names} must be an integer{' or None' if optional else ''}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{names} must be at least {minimum}, got {value}")


@dataclass(frozen=True)
class Retention:
    """Which committed checkpoints retention deletes (a pure policy; see
    :mod:`fastpersist.timeline` for what live and abandoned mean).

    Keep the last ``keep`` commits of the live timeline (None: all), plus every live step that
    is a multiple of ``every``; abandoned checkpoints by ``abandoned`` (``"keep"``, the
    default, or ``"delete"``). Never the latest commit, nor any step in ``protected``
    (checkpoints being written or queued). Incomplete checkpoints are not this policy's
    business: they are cleaned at start-up, when no save of this job can be running.
    """

    keep: int | None = None
    every: int | None = None
    abandoned: str = "keep"

    @property
    def keep_last(self) -> int | None:
        """``keep``, by its name in earlier releases."""
        return self.keep

    @property
    def keep_every(self) -> int | None:
        """``every``, by its name in earlier releases."""
        return self.every

    def __post_init__(self) -> None:
        _count(self.keep, "keep (Retention(keep=...))")
        _count(self.every, "keep_every (Retention(every=...))")
        if self.abandoned not in ABANDONED_POLICIES:
            raise ValueError(f"abandoned must be one of {ABANDONED_POLICIES}, got {self.abandoned!r}")

    def to_delete(self, commits: Sequence[Commit], protected: Iterable[int] = ()) -> list[int]:
        """The steps to delete, in commit order."""
        ordered = in_commit_order(commits)
        dead = abandoned_steps(ordered)
        live = [c.step for c in ordered if c.step not in dead]
        keep = set(protected)
        if ordered:
            keep.add(ordered[-1].step)
        keep |= set(live if self.keep is None else live[-self.keep:])
        if self.every:
            keep |= {s for s in live if s % self.every == 0}
        if self.abandoned == "keep":
            keep |= dead
        return [c.step for c in ordered if c.step not in keep]


@dataclass(frozen=True)
class Durable:
    """The durable tier committed checkpoints are drained to, in the background.

    ``location``: a directory (a shared filesystem) or an ``s3://bucket/prefix`` URL
    (credentials from the environment), or a :class:`fastpersist.tiers.durable.store.Store`.
    ``every``: drain the first checkpoint, then the first at least this many steps after the
    last drained (default 1). ``keep``: the durable tier's own retention over its live
    timeline (None: keep all; its latest is never deleted). ``bandwidth``: bytes/s one rank's
    drain may move (None: unbounded).
    """

    location: Any
    every: int = 1
    keep: int | None = None
    bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.location, (str, os.PathLike)) and not hasattr(self.location, "url"):
            raise TypeError(f"durable: a directory, an s3:// URL or a Store, got {type(self.location).__name__}")
        _count(self.every, "durable_every (Durable(every=...))", optional=False)
        _count(self.keep, "durable_keep (Durable(keep=...))")
        b = self.bandwidth
        if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or b <= 0):
            raise ValueError(f"durable_bandwidth (Durable(bandwidth=...)) must be a positive number of bytes per "
                             f"second, got {b!r}")


@dataclass(frozen=True)
class Nodes:
    """The job's nodes: this process's node id (default ``$FASTPERSIST_NODE``, else the host
    name; a node's ranks share its local roots) and on how many nodes every byte lies
    (``redundancy``; default 2 on several nodes, 1 on one; more than the nodes is refused)."""

    node: str | None = None
    redundancy: int | None = None

    def __post_init__(self) -> None:
        if self.node is not None and not isinstance(self.node, str):
            raise TypeError(f"node must be a string (a node id), got {type(self.node).__name__}")
        _count(self.redundancy, "redundancy (Nodes(redundancy=...))")


class Shorthands(TypedDict, total=False):
    """The Checkpointer's keywords of earlier releases: shorthands for the options' fields."""

    keep: int | None  # Retention.keep
    keep_every: int | None  # Retention.every
    abandoned: str  # Retention.abandoned
    durable_every: int  # Durable.every
    durable_keep: int | None  # Durable.keep
    durable_bandwidth: float | None  # Durable.bandwidth
    node: str | None  # Nodes.node
    redundancy: int | None  # Nodes.redundancy


SHORTHANDS = {
    "keep": ("retention", "keep"), "keep_every": ("retention", "every"), "abandoned": ("retention", "abandoned"),
    "durable_every": ("durable", "every"), "durable_keep": ("durable", "keep"),
    "durable_bandwidth": ("durable", "bandwidth"), "node": ("nodes", "node"), "redundancy": ("nodes", "redundancy"),
}


@dataclass(frozen=True)
class Options:
    """The option objects a Checkpointer was given, each one way or the other."""

    retention: Retention
    durable: Durable | None
    nodes: Nodes


def from_shorthands(retention: Retention | None, durable: Any, nodes: Nodes | None,
                    shorthands: Mapping[str, Any]) -> Options:
    """The options, from the objects and the keyword shorthands (see the module).

    Raises:
        TypeError: an unknown keyword, an option given both ways, or a wrong type.
        ValueError: a value out of range (named as the caller wrote it).
    """
    unknown = sorted(set(shorthands) - set(SHORTHANDS))
    if unknown:
        raise TypeError(f"Checkpointer() got an unexpected keyword argument {unknown[0]!r}")
    given: dict[str, dict[str, Any]] = {"retention": {}, "durable": {}, "nodes": {}}
    for key, value in shorthands.items():
        group, field_name = SHORTHANDS[key]
        given[group][field_name] = value
    objects = {"retention": retention, "nodes": nodes, "durable": durable if isinstance(durable, Durable) else None}
    for group, fields in given.items():
        if fields and objects[group] is not None:
            both = sorted(k for k in shorthands if SHORTHANDS[k][0] == group)
            raise TypeError(f"{group}= and its shorthand(s) {both} were both given: pass one or the other")
    if durable is None:
        Durable("", **given["durable"])  # checked all the same; without a durable tier they do nothing
    elif not isinstance(durable, Durable):
        durable = Durable(durable, **given["durable"])
    return Options(retention if retention is not None else Retention(**given["retention"]),
                   durable, nodes if nodes is not None else Nodes(**given["nodes"]))
