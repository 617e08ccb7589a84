"""benchmarks/time_to_gain.py: its pure parts on hand-made metrics rows and manifests (no model is loaded)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "time_to_gain.py"
_spec = importlib.util.spec_from_file_location("time_to_gain_bench", _PATH)
ttg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ttg)

# two offline rows, then three online ones (iterations 2..4); iteration 3 trained only the actor
ROWS = [
    {"iteration": 0, "phase": "offline", "time_s": 30.0, "reward_mean": 0.4, "trained_agents": ["reasoner", "actor"]},
    {"iteration": 1, "phase": "offline", "time_s": 30.0, "reward_mean": 0.5, "trained_agents": ["reasoner", "actor"]},
    {"iteration": 2, "phase": "online", "rollout_s": 20.0, "time_s": 40.0, "reward_mean": 0.25,
     "trained_agents": ["reasoner", "actor"]},
    {"iteration": 3, "phase": "online", "rollout_s": 30.0, "time_s": 60.0, "reward_mean": 0.5,
     "trained_agents": ["actor"]},
    {"iteration": 4, "phase": "online", "rollout_s": 15.0, "time_s": 15.0, "reward_mean": 0.75,
     "trained_agents": ["reasoner", "actor"]},
]
UNTUNED = {"reasoner": "v1", "actor": "v1"}


def _manifest(iteration: float | None, reward: float | None = None) -> dict:
    metrics = {} if iteration is None else {"iteration": iteration, "reward_mean": reward}
    return {"run_id": "untuned" if iteration is None else "demo", "metrics": metrics}


def _manifests(with_iteration: bool = True) -> dict:
    # the trainer's manifest iteration is the row iteration + 1 (counted after the update)
    def m(row_it: int, reward: float) -> dict:
        return _manifest(row_it + 1.0 if with_iteration else None, reward)

    return {"reasoner": {"v1": _manifest(None), "v2": m(2, 0.25), "v3": m(4, 0.75)},
            "actor": {"v1": _manifest(None), "v2": m(2, 0.25), "v3": m(3, 0.5), "v4": m(4, 0.75)}}


def test_online_minutes_sum_rollout_and_update_of_online_rows_only():
    minutes = ttg.online_minutes(list(reversed(ROWS)))  # row order does not matter
    assert list(minutes) == [2, 3, 4]
    assert minutes[2] == pytest.approx(1.0)
    assert minutes[3] == pytest.approx(2.5)
    assert minutes[4] == pytest.approx(3.0)
    assert ttg.offline_minutes(ROWS) == pytest.approx(1.0)


def test_online_minutes_treat_a_missing_rollout_time_as_zero():
    rows = [{"iteration": 0, "phase": "online", "rollout_s": None, "time_s": 60.0}]
    assert ttg.online_minutes(rows) == {0: pytest.approx(1.0)}


def test_version_iterations_from_the_manifest_iteration_minus_one():
    published, how = ttg.version_iterations(_manifests(), ROWS, UNTUNED)
    assert how == "manifest"
    assert published == {"reasoner": {"v2": 2, "v3": 4}, "actor": {"v2": 2, "v3": 3, "v4": 4}}


def test_version_iterations_by_order_without_a_manifest_iteration():
    published, how = ttg.version_iterations(_manifests(with_iteration=False), ROWS, UNTUNED)
    assert how == "order"
    assert published == {"reasoner": {"v2": 2, "v3": 4}, "actor": {"v2": 2, "v3": 3, "v4": 4}}


def test_version_iterations_refuse_a_reward_that_is_not_the_rows():
    manifests = _manifests()
    manifests["actor"]["v3"]["metrics"]["reward_mean"] = 0.9
    with pytest.raises(ValueError, match="actor/v3"):
        ttg.version_iterations(manifests, ROWS, UNTUNED)


def test_version_iterations_refuse_a_version_past_the_online_rows():
    manifests = _manifests()
    manifests["actor"]["v5"] = _manifest(9.0, 0.5)
    with pytest.raises(ValueError, match="no online row"):
        ttg.version_iterations(manifests, ROWS, UNTUNED)


def test_versions_at_take_the_newest_published_else_untuned():
    published, _ = ttg.version_iterations(_manifests(), ROWS, UNTUNED)
    assert ttg.versions_at(1, published, UNTUNED) == UNTUNED
    assert ttg.versions_at(2, published, UNTUNED) == {"reasoner": "v2", "actor": "v2"}
    assert ttg.versions_at(3, published, UNTUNED) == {"reasoner": "v2", "actor": "v3"}
    assert ttg.versions_at(4, published, UNTUNED) == {"reasoner": "v3", "actor": "v4"}


def test_checkpoints_every_nth_online_iteration_and_the_last():
    assert ttg.checkpoint_iterations([2, 3, 4, 5, 6], 2) == [3, 5, 6]
    assert ttg.checkpoint_iterations([2, 3, 4, 5], 2) == [3, 5]
    assert ttg.checkpoint_iterations([2], 2) == [2]
    assert ttg.checkpoint_iterations([4, 2, 3], 1) == [2, 3, 4]
    assert ttg.checkpoint_iterations([], 2) == []
    with pytest.raises(ValueError):
        ttg.checkpoint_iterations([1], 0)


def test_first_significant_is_the_first_checkpoint_with_ci_low_above_zero():
    cps = [{"online_minutes": 6.0, "low": 0.01}, {"online_minutes": 2.0, "low": -0.1},
           {"online_minutes": 4.0, "low": 0.0}, {"online_minutes": 8.0, "low": 0.2}]
    assert ttg.first_significant(cps) == 6.0
    assert ttg.first_significant([{"online_minutes": 1.0, "low": None}, {"online_minutes": 2.0, "low": -0.3}]) is None
    assert ttg.first_significant([]) is None


def test_excludes_zero_either_side():
    assert ttg.excludes_zero(0.1, 0.3)
    assert ttg.excludes_zero(-0.3, -0.1)
    assert not ttg.excludes_zero(-0.1, 0.1)
    assert not ttg.excludes_zero(0.0, 0.2)
    assert not ttg.excludes_zero(None, None)


def test_median_counts_never_significant_as_infinitely_slow():
    assert ttg.median_minutes([3.0, 5.0, None]) == 5.0
    assert ttg.median_minutes([3.0, None, None]) is None
    assert ttg.median_minutes([3.0, 5.0]) == 4.0
    assert ttg.median_minutes([]) is None
    assert not math.isinf(ttg.median_minutes([1.0]))


class _FakeCollector:
    """Stands in for GraphCollector: records which episodes it ran; one without actions per job."""

    def __init__(self, app, *, concurrency):
        self.calls: list[list[str]] = []
        self.failures: list = []

    def run(self, jobs):
        import pandas as pd

        from marft_lg.graph.collect import EpisodeFailure
        from marft_lg.trajectories.columns import EPISODE_COLUMNS
        from marft_lg.trajectories.dataset import TrajectoryDataset

        ids = [j.episode_id for j in jobs]
        self.calls.append(ids)
        self.failures = [EpisodeFailure.of(j, RuntimeError("boom")) for j in jobs if j.episode_id.endswith("-crash")]
        now = pd.Timestamp.now(tz="UTC")
        rows = [dict.fromkeys(EPISODE_COLUMNS) | {"episode_id": e, "start_time": now} for e in ids]
        return TrajectoryDataset(episodes=pd.DataFrame(rows, columns=list(EPISODE_COLUMNS)))


def _jobs(candidate: str) -> list:
    from marft_lg.graph.collect import EpisodeJob
    from marft_lg.trajectories.scenarios import Scenario

    def job(side: str, eid: str, versions: dict) -> EpisodeJob:
        return EpisodeJob(Scenario(eid, {}), eid, 1, versions, {ttg.SIDE_KEY: side})

    return [job("baseline", "b-s1", UNTUNED), job("baseline", "b-s2-crash", UNTUNED),
            job("candidate", f"c{candidate}-s1", {"actor": candidate}),
            job("candidate", f"c{candidate}-s2", {"actor": candidate})]


def test_baseline_once_replays_the_untuned_side_only_at_the_first_checkpoint(monkeypatch):
    monkeypatch.setattr("marft_lg.graph.collect.GraphCollector", _FakeCollector)
    runner = ttg.BaselineOnce(app=None, concurrency=4)
    first = runner.run(_jobs("v2"))
    assert sorted(first.episode_ids) == ["b-s1", "b-s2-crash", "cv2-s1", "cv2-s2"]
    assert [str(f) for f in runner.failures] == ["b-s2-crash: RuntimeError: boom"]
    second = runner.run(_jobs("v3"))
    assert runner.collector.calls[-1] == ["cv3-s1", "cv3-s2"]  # the baseline is not run again
    assert sorted(second.episode_ids) == ["b-s1", "b-s2-crash", "cv3-s1", "cv3-s2"]
    assert [str(f) for f in runner.failures] == ["b-s2-crash: RuntimeError: boom"]  # still counts against it


def test_baseline_once_is_a_runner_shadow_compare_can_use(monkeypatch):
    """shadow_compare's replay step reads the runner's `failures` (its first run crashed on an `errors` field)."""
    from marft_lg.evaluation.shadow import _replay

    monkeypatch.setattr("marft_lg.graph.collect.GraphCollector", _FakeCollector)
    runner = ttg.BaselineOnce(app=None, concurrency=4)
    replayed, failed = _replay(None, _jobs("v2"), runner, None, 4, False)
    assert sorted(replayed.episode_ids) == ["b-s1", "b-s2-crash", "cv2-s1", "cv2-s2"]
    assert [f.episode_id for f in failed] == ["b-s2-crash"]
