"""docs/FORMAT.md states the format versions the code writes (it once said manifest version 2
while the code wrote 3)."""

from __future__ import annotations

import os
import re

from fastpersist.format import manifest, torchzip
from helpers import REPO

FORMAT_MD = os.path.join(REPO, "docs", "FORMAT.md")


def _text() -> str:
    with open(FORMAT_MD, encoding="utf-8") as f:
        return f.read()


def test_headings_name_the_versions_the_code_writes():
    text = _text()
    single = re.search(r"^## Single file .*version (\d+)$", text, re.M)
    sharded = re.search(r"^## Sharded checkpoint .*version (\d+)$", text, re.M)
    assert single and int(single.group(1)) == torchzip.FORMAT_VERSION
    assert sharded and int(sharded.group(1)) == manifest.FORMAT_VERSION


def test_manifest_table_names_the_version_the_code_writes():
    row = re.search(r"^\| `version` \| `(\d+)`", _text(), re.M)
    assert row and int(row.group(1)) == manifest.FORMAT_VERSION
