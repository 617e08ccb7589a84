"""Every benchmark results file says which code it measured (a stale figure once hid a regression)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

RESULTS = sorted((Path(__file__).resolve().parents[2] / "benchmarks" / "results").glob("*.json"))


def test_there_are_results_files():
    assert len(RESULTS) >= 8


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_each_results_file_records_its_commit(path):
    data = json.loads(path.read_text())
    assert isinstance(data, dict), f"{path.name}: expected a JSON object"
    commit = data.get("commit")
    assert isinstance(commit, str) and re.fullmatch(r"[0-9a-f]{40}", commit), (
        f"{path.name}: top-level 'commit' must be the full sha of the code measured, got {commit!r}")


def test_code_state_names_this_checkout():
    from marft_lg._provenance import code_state

    state = code_state()
    assert set(state) == {"commit", "dirty"}
    if state["commit"] is not None:  # a git checkout (CI clones one)
        assert re.fullmatch(r"[0-9a-f]{40}", state["commit"]) and isinstance(state["dirty"], bool)
