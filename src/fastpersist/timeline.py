"""Commit order and timelines. Pure: the catalog reads, the Checkpointer decides.

Users resume from an older checkpoint after a loss spike or a bad data shard: with checkpoints
8, 9, 10 committed, a job resumed from 5 saves 6, 7, ... The rules fastpersist follows:

- **"latest" is the most recent commit, not the largest step.** Every manifest records its
  ``sequence``, one more than any commit before it in these roots; ``latest`` is the commit with
  the highest sequence (manifests without one, written before sequences existed, are ordered by
  their creation time and come before any that has one).
- **A save whose step is smaller than the largest step on the live timeline starts a new
  timeline.** The checkpoints committed before it with a larger step (8, 9, 10 above) are
  *abandoned* (one of the same step is replaced): formally, walking the commits from the most recent one backwards, a
  commit is live when its step is smaller than the step of every live commit after it.
- **Retention counts live commits only**, in commit order, and never deletes a live checkpoint
  in favour of an abandoned one. Abandoned checkpoints are kept by default (a rollback is often
  undone, and deleting data is the one mistake that cannot be taken back);
  ``abandoned="delete"`` deletes them at the next commit instead.
- Saving a step that already exists replaces its directory (a checkpoint is addressed by step):
  resuming from 5 and saving 6 replaces the abandoned 6.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Commit:
    """One committed checkpoint, as the timeline sees it."""

    step: int
    sequence: int  # 0: not recorded (written before commit sequences existed)
    created: float

    @property
    def order(self) -> tuple[int, float, int]:
        return (self.sequence, self.created, self.step)


def in_commit_order(commits: Iterable[Commit]) -> list[Commit]:
    return sorted(commits, key=lambda c: c.order)


def abandoned_steps(commits: Iterable[Commit]) -> set[int]:
    """The steps of commits that a later commit of a smaller or equal step abandoned."""
    smallest_after: int | None = None
    out: set[int] = set()
    for c in reversed(in_commit_order(commits)):
        if smallest_after is not None and c.step >= smallest_after:
            out.add(c.step)
        else:
            smallest_after = c.step
    return out


def live_steps(commits: Iterable[Commit]) -> list[int]:
    """The live timeline's steps, in commit order (which is also step order)."""
    ordered = in_commit_order(commits)
    dead = abandoned_steps(ordered)
    return [c.step for c in ordered if c.step not in dead]


def latest(commits: Iterable[Commit]) -> int | None:
    ordered = in_commit_order(commits)
    return ordered[-1].step if ordered else None


def abandoned_by(step: int, commits: Sequence[Commit]) -> list[int]:
    """The live steps that committing ``step`` now would abandon (empty: same timeline). An
    existing checkpoint of ``step`` itself is replaced, not abandoned."""
    return [s for s in live_steps(commits) if s > step]


def next_sequence(commits: Iterable[Commit]) -> int:
    return max((c.sequence for c in commits), default=0) + 1
