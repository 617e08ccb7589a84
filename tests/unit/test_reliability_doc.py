"""docs/reliability.md promises things and names the test that keeps each true: every named test must exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_test_the_reliability_table_names_exists():
    text = (ROOT / "docs" / "reliability.md").read_text()
    sources = {p: p.read_text() for p in (ROOT / "tests").rglob("*.py")}
    named = re.findall(r"`(tests/[\w/]+\.py)((?:::\w+)?)`", text)
    assert len(named) > 30
    missing = []
    for path, test in named:
        source = sources.get(ROOT / path)
        if source is None or (test and f"def {test[2:]}(" not in source):
            missing.append(path + test)
    for test in re.findall(r"`::(\w+)`", text):  # a further test of the file named before it in the row
        if not any(f"def {test}(" in s for s in sources.values()):
            missing.append(test)
    assert not missing, missing
