"""The crash harness of the demo and the GPU check (benchmarks/_bench/crash.py): the kill lands
in the middle of the chosen checkpoint's write because the child says it is there, not by timing."""

from __future__ import annotations

import bench_path  # noqa: F401  (benchmarks/ on sys.path)
from _bench.crash import crash_and_resume
from _bench.models import ModelSpec

TINY = ModelSpec(vocab=64, d=16, layers=1, heads=2, seq=8, batch=2, dropout=0.1, experts=2)


def test_the_kill_lands_in_the_chosen_write_and_the_run_resumes_exactly(tmp_path):
    """The killed child stalls at step 3's second data-file write and signals; the harness sends
    SIGKILL on that signal. Step 3's checkpoint is left with data and no manifest, the run resumes
    from step 2 (its overlap save was committed before step 3's began), and every resumed loss
    equals the uninterrupted run's, bit for bit."""
    r = crash_and_resume(str(tmp_path), spec=TINY, steps=6, kill_after=3, timeout_s=120)
    assert r["returncode"] == -9
    assert r["killed_mid_write"]
    # what the kill left (before the resumed run cleaned it): step 3's data, begun, no manifest;
    # and, if the kill came while retention (keep=2) was deleting step 0 after step 2's commit,
    # step 0 without its manifest (removed first), never a step retention keeps
    assert list(r["in_progress"]) == ["step-00000003"]
    assert r["in_progress"]["step-00000003"] > 0, "the first data write of the checkpoint did not reach its file"
    assert set(r["being_deleted"]) <= {"step-00000000"}
    assert r["left_after_resume"] == []
    assert r["resumed_from"] == 2
    reference, resumed = r["reference"], r["resumed"]
    assert sorted(reference) == list(range(6)) and sorted(resumed) == [3, 4, 5]
    assert all(resumed[s] == reference[s] for s in resumed)
    assert max(r["killed"]) == 3 and all(r["killed"][s] == reference[s] for s in r["killed"])
