"""What an end-to-end test can assert of a gate decision whichever way it went: that it follows from its checks, and
that each check's verdict and value follow from the comparison it was made on."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

_AT_LEAST = {"enough_pairs", "team_reward_gain"}  # passed when value >= threshold


def assert_decision_follows_from_the_comparison(run_dir: Path, comparison: dict | None = None) -> dict:
    """`decision.json` against `comparison.json` of one compare run (or `comparison`, the result's dict as a run
    logged it); returns the decision."""
    decision = json.loads((run_dir / "decision.json").read_text())
    comparison = comparison or json.loads((run_dir / "comparison.json").read_text())
    checks = {c["name"]: c for c in decision["checks"]}
    assert decision["promote"] == all(c["passed"] for c in checks.values())
    assert decision["decision"] == ("promote" if decision["promote"] else "reject")
    assert decision["reasons"] == [c["detail"] for c in decision["checks"] if not c["passed"]]
    team = comparison["team_reward"]
    assert checks["enough_pairs"]["value"] == comparison["n_pairs"] == team["n"]
    assert checks["team_reward_gain"]["value"] == pytest.approx(team["mean"])
    for name, c in checks.items():
        value, bound = c["value"], c["threshold"]
        if name in _AT_LEAST:
            assert c["passed"] == (value is not None and value >= bound), c
        elif name == "team_reward_ci_lower_above_zero":
            assert value == pytest.approx(team["low"]) and c["passed"] == (value is not None and value > 0), c
        elif name.startswith("component:"):
            delta = comparison["components"][name.split(":", 1)[1]]["mean"]
            assert value == pytest.approx(delta)
            assert c["passed"] == (value >= bound if bound <= 0 else value <= bound), c
        elif name == "cost_ratio":
            ratio = comparison["cost_ratio_tokens"]
            assert value is None or value == pytest.approx(ratio)
            assert c["passed"] == (ratio is None or math.isnan(ratio) or ratio <= bound), c
    return decision
