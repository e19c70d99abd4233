"""Importing fastpersist (and its integrations package) imports no training framework."""

from __future__ import annotations

import subprocess
import sys

from integration_util import SRC


def test_import_fastpersist_imports_no_framework() -> None:
    code = ("import sys, fastpersist, fastpersist.integrations\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
            "('lightning', 'pytorch_lightning', 'transformers', 'accelerate', 'torchtitan'))\n"
            "print(' '.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": SRC}, capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == ""
