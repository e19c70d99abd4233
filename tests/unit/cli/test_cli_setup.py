"""scripts/setup.sh: a project-local .venv, set up once, then skipped while current."""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers import REPO
STAMP = os.path.join(REPO, ".venv", ".fastpersist-setup")


def test_scripts_use_the_project_environment():
    """The commands must not install into, or run from, the user's own Python environment."""
    for name in ("test.sh", "demo.sh", "bench.sh"):
        text = open(os.path.join(REPO, "scripts", name)).read()
        assert "bash scripts/setup.sh" in text and ".venv/bin/python" in text, name
        assert "python3 -m" not in text, name
    setup = open(os.path.join(REPO, "scripts", "setup.sh")).read()
    assert "-m venv" in setup and "--system-site-packages" not in setup
    assert "torch==2.13.0" in setup and "-c \"$CONSTRAINT\"" in setup
    assert ".venv/" in open(os.path.join(REPO, ".gitignore")).read().split()


@pytest.mark.skipif(not os.path.exists(STAMP), reason="no .venv set up by scripts/setup.sh here")
def test_second_setup_run_is_quick_and_changes_nothing():
    """A run past the "complete and current" check deletes the stamp first and writes it again
    last: an unchanged stamp file (same inode, same mtime) and an unchanged site-packages mean
    that nothing was reinstalled (whatever the time the run took on a busy machine)."""
    def installed() -> tuple:
        stamp = os.stat(STAMP)
        lib = os.path.join(REPO, ".venv", "lib")
        site = [os.path.join(lib, v, "site-packages") for v in sorted(os.listdir(lib))]
        return (stamp.st_ino, stamp.st_mtime_ns, [(p, os.stat(p).st_mtime_ns, sorted(os.listdir(p))) for p in site])

    before = installed()
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh")], check=True, timeout=600,
                         capture_output=True, text=True,
                         env={k: v for k, v in os.environ.items() if k != "FASTPERSIST_SETUP_FORCE"})
    assert installed() == before, "setup reinstalled although .venv was complete"
    assert out.stdout == "" and out.stderr == ""  # it said nothing: it did nothing
