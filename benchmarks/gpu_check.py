"""The prepared GPU run of issue 13 (the code lives in fastpersist.cli.gpu_check, so that
``fastpersist bench --gpu`` runs the same thing). Run the smoke test first:

    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --out /tmp/gpu-smoke
    PYTHONPATH=src python benchmarks/gpu_check.py --out /tmp/gpu-full
"""

from __future__ import annotations

import sys

from fastpersist.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
