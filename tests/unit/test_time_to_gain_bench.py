"""benchmarks/time_to_gain.py: how it collects the runs' curves (the curves themselves: tests/unit/test_demo_curve.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "time_to_gain.py"
_spec = importlib.util.spec_from_file_location("time_to_gain_bench", _PATH)
ttg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttg)


def _runs(*minutes):
    return [{"seed": k, "run_dir": f"runs/s{k}", "minutes_to_significant_gain": m} for k, m in enumerate(minutes)]


def test_the_median_counts_a_run_that_never_got_there_as_infinitely_slow():
    out = ttg.summarise(_runs(3.0, None, 5.0))
    assert out["minutes_to_significant_gain"]["median"] == 5.0
    assert out["minutes_to_significant_gain"]["seeds_significant"] == 2
    assert out["minutes_to_significant_gain"]["per_seed"][1] == {"seed": 1, "run_dir": "runs/s1", "minutes": None}
    assert out["meets_goal"] is True


def test_no_median_and_no_goal_when_half_the_runs_never_got_there():
    out = ttg.summarise(_runs(3.0, None, None))
    assert out["minutes_to_significant_gain"]["median"] is None
    assert out["meets_goal"] is False
    assert ttg.summarise(_runs(9.0))["meets_goal"] is False  # significant, but after the goal's minutes
