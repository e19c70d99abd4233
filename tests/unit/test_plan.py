"""The planner, in one process: ranks are simulated by calling it once per rank."""

from __future__ import annotations

import random

import pytest

from fastpersist.plan import ALIGN, cuts, plan, plan_digest, slot_loads

ODD = [0, 1, 4095, 4097, 0, 3 * ALIGN + 17, 1, 4096]


def _states() -> dict[str, list[int]]:
    rng = random.Random(7)
    return {
        "odd": ODD,
        "one huge": [0, 1, 1 << 30, 4095],
        "many tiny": [rng.randrange(0, 300) for _ in range(2000)],
        "mixed": [rng.choice([0, 1, 4095, 4097, rng.randrange(1, 1 << 22)]) for _ in range(300)] + [1 << 28],
        "empty": [],
        "all empty": [0, 0, 0],
    }


def _check(sizes: list[int], slots: int) -> None:
    extents = plan(sizes, slots)
    # every byte of every storage exactly once, in order
    covered = [0] * len(sizes)
    for e in extents:
        assert e.nbytes > 0
        assert e.start == covered[e.storage], f"hole or overlap in storage {e.storage}"
        covered[e.storage] = e.end
    assert covered == sizes
    # stream order, each slot's extents contiguous and slots in order
    assert [e.slot for e in extents] == sorted(e.slot for e in extents)
    # balance: within one alignment unit of the ideal
    total = sum(sizes)
    for load in slot_loads(extents, slots):
        assert abs(load - total / slots) <= ALIGN, (load, total / slots)
    # cuts inside a storage are aligned; storages smaller than the unit are never split
    for e in extents:
        if e.start:
            assert e.start % ALIGN == 0
        if sizes[e.storage] < ALIGN:
            assert e.nbytes == sizes[e.storage]


@pytest.mark.parametrize("state", sorted(_states()))
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("roots", [1, 2, 3, 4])
def test_plan_covers_balances_and_aligns(state: str, ranks: int, roots: int) -> None:
    _check(_states()[state], ranks * roots)


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_every_rank_computes_the_same_plan(ranks: int) -> None:
    """Each simulated rank plans on its own, from its own copy of the sizes."""
    sizes = _states()["mixed"]
    plans = [plan(list(sizes), ranks * 2) for _ in range(ranks)]
    digests = {plan_digest(list(sizes), ranks * 2) for _ in range(ranks)}
    assert all(p == plans[0] for p in plans)
    assert len(digests) == 1


def test_digest_changes_with_sizes_slots_and_extra() -> None:
    base = plan_digest(ODD, 4)
    assert plan_digest(ODD[:-1] + [4097], 4) != base
    assert plan_digest(ODD, 5) != base
    assert plan_digest(ODD, 4, extra=b"x") != base


def test_small_storages_are_packed_not_split() -> None:
    sizes = [100] * 1000  # 100 kB of tiny storages over 4 writers
    extents = plan(sizes, 4)
    assert len(extents) == 1000
    loads = slot_loads(extents, 4)
    assert all(abs(x - 25_000) <= 100 for x in loads)


def test_more_writers_than_bytes() -> None:
    extents = plan([1, 4097], 8)
    assert sum(e.nbytes for e in extents) == 4098
    assert sorted({e.slot for e in extents}) != list(range(8))  # some writers get nothing


def test_cuts_are_monotone() -> None:
    rng = random.Random(3)
    for _ in range(200):
        sizes = [rng.randrange(0, 50_000) for _ in range(rng.randrange(0, 20))]
        c = cuts(sizes, rng.randrange(1, 17))
        assert c == sorted(c) and c[0] == 0 and c[-1] == sum(sizes)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        plan([1, 2], 0)
    with pytest.raises(ValueError):
        plan([-1], 2)
