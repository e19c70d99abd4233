"""fastpersist's own fuzz suite: seeded mutations of both formats (issue 14, item 6).

Every case copies a pristine checkpoint, damages or crafts it (byte flips, truncations, zeroed
pages, deleted/swapped/duplicated files, hostile JSON values, symlinks, FIFOs and devices, zip
directory tricks, decompression bombs, code-running pickles; see tests/fuzz/cases.py), then
loads it (and, sharded, verifies it) in a forked child with a memory limit and a timeout. A case
must end exact, or in a CheckpointError naming the checkpoint; ``crafted`` cases (checksums
recomputed) may also load a different, self-consistent checkpoint. Anything else (wrong data,
hang, out of memory, crash, another exception, load and verify disagreeing, code that ran)
fails the test, with each failing case's seed and index to reproduce it:

    cd tests && PYTHONPATH=../src:. python -m fuzz --format sharded --seed 14 --case 123

Default: 200 cases per format (about a minute here). ``-m long``: 2,500 per format.
``FASTPERSIST_FUZZ_SEED`` and ``FASTPERSIST_FUZZ_CASES`` override the seed and the count.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from fuzz.cases import FAILURES, Bases, run_many

SEED = int(os.environ.get("FASTPERSIST_FUZZ_SEED", "14"))


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> Bases:
    return Bases(str(tmp_path_factory.mktemp("fuzz-bases")))


def _run(bases: Bases, tmp_path, fmt: str, count: int) -> None:
    count = int(os.environ.get("FASTPERSIST_FUZZ_CASES", count))
    by_family: Counter[tuple[str, str]] = Counter()
    counts, failures = run_many(bases, fmt, SEED, count, str(tmp_path), by_family)
    print(f"\nfuzz {fmt} seed {SEED}: {count} cases: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for name in sorted({f for f, _ in by_family}):
        print(f"  {name:>16}: " + ", ".join(f"{k} {v}" for (f, k), v in sorted(by_family.items()) if f == name))
    assert sum(counts.values()) == count
    assert counts["exact"] and counts["checkpoint_error"], "the mutations must exercise both outcomes"
    assert not any(counts[k] for k in FAILURES), "\n".join(failures[:20])


@pytest.mark.parametrize("fmt", ["single", "sharded"])
def test_fuzz(bases, tmp_path, fmt):
    _run(bases, tmp_path, fmt, 200)


@pytest.mark.long
@pytest.mark.parametrize("fmt", ["single", "sharded"])
def test_fuzz_long(bases, tmp_path, fmt):
    _run(bases, tmp_path, fmt, 2500)
