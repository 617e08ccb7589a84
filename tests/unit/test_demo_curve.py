"""marft_lg.demo_curve: reading a finished run's metrics rows and manifests, choosing checkpoints, the reused
baseline, the plot and the report section (no model is loaded; the replays run end to end in tests/e2e/test_demo.py)."""

from __future__ import annotations

import math

import pytest

from marft_lg import demo_curve as dc
from marft_lg.evaluation.shadow import BaselineOnce

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
    minutes = dc.online_minutes(list(reversed(ROWS)))  # row order does not matter
    assert list(minutes) == [2, 3, 4]
    assert minutes[2] == pytest.approx(1.0)
    assert minutes[3] == pytest.approx(2.5)
    assert minutes[4] == pytest.approx(3.0)
    assert dc.offline_minutes(ROWS) == pytest.approx(1.0)


def test_online_minutes_treat_a_missing_rollout_time_as_zero():
    rows = [{"iteration": 0, "phase": "online", "rollout_s": None, "time_s": 60.0}]
    assert dc.online_minutes(rows) == {0: pytest.approx(1.0)}


def test_version_iterations_from_the_manifest_iteration_minus_one():
    published, how = dc.version_iterations(_manifests(), ROWS, UNTUNED)
    assert how == "manifest"
    assert published == {"reasoner": {"v2": 2, "v3": 4}, "actor": {"v2": 2, "v3": 3, "v4": 4}}


def test_version_iterations_by_order_without_a_manifest_iteration():
    published, how = dc.version_iterations(_manifests(with_iteration=False), ROWS, UNTUNED)
    assert how == "order"
    assert published == {"reasoner": {"v2": 2, "v3": 4}, "actor": {"v2": 2, "v3": 3, "v4": 4}}


def test_version_iterations_refuse_a_reward_that_is_not_the_rows():
    manifests = _manifests()
    manifests["actor"]["v3"]["metrics"]["reward_mean"] = 0.9
    with pytest.raises(ValueError, match="actor/v3"):
        dc.version_iterations(manifests, ROWS, UNTUNED)


def test_version_iterations_refuse_a_version_past_the_online_rows():
    manifests = _manifests()
    manifests["actor"]["v5"] = _manifest(9.0, 0.5)
    with pytest.raises(ValueError, match="metrics row 8, which the run's metrics do not hold"):
        dc.version_iterations(manifests, ROWS, UNTUNED)


def test_a_version_the_offline_stage_published_is_the_team_from_the_first_online_iteration_on():
    """The demo publishes the offline stage's changes before the comparison's untuned side runs (manifest iteration
    2: the count after offline row 1); the on-policy versions follow it."""
    manifests = {"reasoner": {"v1": _manifest(None), "v2": {"run_id": "demo", "metrics": {"iteration": 2.0}},
                              "v3": _manifest(3.0, 0.25)},
                 "actor": {"v1": _manifest(None), "v2": {"run_id": "demo", "metrics": {"iteration": 2.0}},
                           "v3": _manifest(4.0, 0.5)}}
    published, how = dc.version_iterations(manifests, ROWS, UNTUNED)
    assert how == "manifest" and published == {"reasoner": {"v2": 1, "v3": 2}, "actor": {"v2": 1, "v3": 3}}
    assert dc.versions_at(0, published, UNTUNED) == UNTUNED
    assert dc.versions_at(2, published, UNTUNED) == {"reasoner": "v3", "actor": "v2"}
    assert dc.versions_at(4, published, UNTUNED) == {"reasoner": "v3", "actor": "v3"}


def test_versions_at_take_the_newest_published_else_untuned():
    published, _ = dc.version_iterations(_manifests(), ROWS, UNTUNED)
    assert dc.versions_at(1, published, UNTUNED) == UNTUNED
    assert dc.versions_at(2, published, UNTUNED) == {"reasoner": "v2", "actor": "v2"}
    assert dc.versions_at(3, published, UNTUNED) == {"reasoner": "v2", "actor": "v3"}
    assert dc.versions_at(4, published, UNTUNED) == {"reasoner": "v3", "actor": "v4"}


def test_checkpoints_every_nth_online_iteration_and_the_last():
    assert dc.checkpoint_iterations([2, 3, 4, 5, 6], 2) == [3, 5, 6]
    assert dc.checkpoint_iterations([2, 3, 4, 5], 2) == [3, 5]
    assert dc.checkpoint_iterations([2], 2) == [2]
    assert dc.checkpoint_iterations([4, 2, 3], 1) == [2, 3, 4]
    assert dc.checkpoint_iterations([], 2) == []
    with pytest.raises(ValueError):
        dc.checkpoint_iterations([1], 0)


def test_first_significant_is_the_first_checkpoint_with_ci_low_above_zero():
    cps = [{"online_minutes": 6.0, "low": 0.01}, {"online_minutes": 2.0, "low": -0.1},
           {"online_minutes": 4.0, "low": 0.0}, {"online_minutes": 8.0, "low": 0.2}]
    assert dc.first_significant(cps) == 6.0
    assert dc.first_significant([{"online_minutes": 1.0, "low": None}, {"online_minutes": 2.0, "low": -0.3}]) is None
    assert dc.first_significant([]) is None


def test_excludes_zero_either_side():
    assert dc.excludes_zero(0.1, 0.3)
    assert dc.excludes_zero(-0.3, -0.1)
    assert not dc.excludes_zero(-0.1, 0.1)
    assert not dc.excludes_zero(0.0, 0.2)
    assert not dc.excludes_zero(None, None)


def test_median_counts_never_significant_as_infinitely_slow():
    assert dc.median_minutes([3.0, 5.0, None]) == 5.0
    assert dc.median_minutes([3.0, None, None]) is None
    assert dc.median_minutes([3.0, 5.0]) == 4.0
    assert dc.median_minutes([]) is None
    assert not math.isinf(dc.median_minutes([1.0]))


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
    from marft_lg.evaluation.shadow import SIDE_KEY
    from marft_lg.graph.collect import EpisodeJob
    from marft_lg.trajectories.scenarios import Scenario

    def job(side: str, eid: str, versions: dict) -> EpisodeJob:
        return EpisodeJob(Scenario(eid, {}), eid, 1, versions, {SIDE_KEY: side})

    return [job("baseline", "b-s1", UNTUNED), job("baseline", "b-s2-crash", UNTUNED),
            job("candidate", f"c{candidate}-s1", {"actor": candidate}),
            job("candidate", f"c{candidate}-s2", {"actor": candidate})]


def test_baseline_once_replays_the_untuned_side_only_at_the_first_checkpoint(monkeypatch):
    monkeypatch.setattr("marft_lg.evaluation.shadow.GraphCollector", _FakeCollector)
    runner = BaselineOnce(app=None, concurrency=4)
    first = runner.run(_jobs("v2"))
    assert sorted(first.episode_ids) == ["b-s1", "b-s2-crash", "cv2-s1", "cv2-s2"]
    assert [str(f) for f in runner.failures] == ["b-s2-crash: RuntimeError: boom"]
    second = runner.run(_jobs("v3"))
    assert runner.collector.calls[-1] == ["cv3-s1", "cv3-s2"]  # the baseline is not run again
    assert sorted(second.episode_ids) == ["b-s1", "b-s2-crash", "cv3-s1", "cv3-s2"]
    assert [str(f) for f in runner.failures] == ["b-s2-crash: RuntimeError: boom"]  # still counts against it


def test_baseline_once_reruns_the_baseline_when_its_pinned_versions_differ(monkeypatch):
    monkeypatch.setattr("marft_lg.evaluation.shadow.GraphCollector", _FakeCollector)
    runner = BaselineOnce(app=None, concurrency=4)
    runner.run(_jobs("v2"))
    moved = [j if j.metadata["marft.compare.side"] == "candidate" else type(j)(j.scenario, j.episode_id, j.seed,
                                                                                {"actor": "v9"}, j.metadata)
             for j in _jobs("v3")]
    runner.run(moved)
    assert runner.collector.calls[-1] == ["b-s1", "b-s2-crash", "cv3-s1", "cv3-s2"]


def test_baseline_once_runs_the_baseline_side_ahead_of_the_comparison(monkeypatch):
    """`run_ahead` plans the same episodes `shadow_compare` will (ids, seeds, versions): the comparison then runs only
    the candidate side."""
    from marft_lg.evaluation.shadow import _plan_replays
    from marft_lg.trajectories.scenarios import Scenario

    monkeypatch.setattr("marft_lg.evaluation.shadow.GraphCollector", _FakeCollector)
    runner = BaselineOnce(app=None, concurrency=4)
    scenarios = [Scenario("p1", {}), Scenario("p2", {})]
    ahead = runner.run_ahead(UNTUNED, scenarios, samples_per_scenario=2, seed=7, run_id="r")
    jobs, side_of = _plan_replays(scenarios, 2, 7, "r", UNTUNED, {**UNTUNED, "actor": "v5"})
    baseline_ids = sorted(e for e, side in side_of.items() if side == "baseline")
    assert sorted(ahead.episode_ids) == baseline_ids and len(baseline_ids) == 4
    both = runner.run(jobs)
    assert runner.collector.calls[-1] == [j.episode_id for j in jobs if side_of[j.episode_id] == "candidate"]
    assert sorted(both.episode_ids) == sorted(side_of)


def test_baseline_once_is_a_runner_shadow_compare_can_use(monkeypatch):
    """shadow_compare's replay step reads the runner's `failures` (its first run crashed on an `errors` field)."""
    from marft_lg.evaluation.shadow import _replay

    monkeypatch.setattr("marft_lg.evaluation.shadow.GraphCollector", _FakeCollector)
    runner = BaselineOnce(app=None, concurrency=4)
    replayed, failed = _replay(None, _jobs("v2"), runner, None, 4, False)
    assert sorted(replayed.episode_ids) == ["b-s1", "b-s2-crash", "cv2-s1", "cv2-s2"]
    assert [f.episode_id for f in failed] == ["b-s2-crash"]


# ---- the report section and the plot ------------------------------------------------------------------------------
def _summary() -> dict:
    """A demo summary as `DemoRun._summary` writes it (numbers made up)."""
    acc = {"strict": 0.15, "lenient": 0.16, "n": 8}
    return {
        "budget": {"name": "full", "minutes": 15, "scenarios_per_iteration": 4, "online_minutes": 8.0},
        "model": "embedded:smollm2-135m-instruct", "seed": 3, "trace_dir": "traces/demo-x", "episodes_traced": 4,
        "episodes_mined": 4, "actions_per_agent": {"reasoner": 4, "actor": 4}, "untuned_train_reward": 0.5,
        "problems": {"traced": 2, "stream": 8, "online_seen": 8, "heldout": 8}, "train_iterations": 3,
        "train_reward_curve": [0.5, 0.6, 0.7],
        "heldout": {"pairs": 8, "baseline_reward": 0.8, "candidate_reward": 0.95,
                    "difference": {"mean": 0.15, "low": 0.02, "high": 0.3, "n": 8},
                    "mde": {"mde": 0.2, "n": 8, "sd": 0.4}, "accuracy": {"baseline": acc, "candidate": acc}},
        "gate": {"promote": True, "reasons": []},
        "versions": {"untuned": UNTUNED, "tuned": {"reasoner": "v3", "actor": "v4"},
                     "live": {"reasoner": "v3", "actor": "v4"}},
        "minutes": 14.0,
    }


CHECKPOINTS = [
    {"iteration": 3, "online_iteration": 2, "online_minutes": 2.5, "versions": {"reasoner": "v2", "actor": "v3"},
     "mean": 0.05, "low": -0.04, "high": 0.14, "n": 8},
    {"iteration": 4, "online_iteration": 3, "online_minutes": 3.0, "versions": {"reasoner": "v3", "actor": "v4"},
     "mean": 0.15, "low": 0.02, "high": 0.3, "n": 8},
]


def test_the_report_shows_each_checkpoint_and_the_first_significant_one(tmp_path):
    from marft_lg.demo import render_report

    summary = {**_summary(), "curve": {"every": 2, "checkpoints": CHECKPOINTS, "minutes_to_significant_gain": 3.0}}
    md = render_report(tmp_path, summary).read_text()
    section = md[md.index("## Held-out gain over training time"):md.index("## Promotion")]
    assert "| 2 | 2.50 | reasoner v2, actor v3 | +0.050 [-0.040, +0.140] |" in section
    assert "| 3 | 3.00 | reasoner v3, actor v4 | +0.150 [+0.020, +0.300] |" in section
    assert "first significant gain: after 3.00 on-policy minutes" in section
    assert "![held-out gain over training time](curve.png)" in section
    assert max(len(line) for line in section.splitlines() if not line.startswith("|")) <= 80
    assert "curve.png" in (tmp_path / "report.html").read_text()


def test_a_report_without_a_curve_says_how_to_measure_it(tmp_path):
    from marft_lg.demo import render_report

    md = render_report(tmp_path, _summary()).read_text()
    section = md[md.index("## Held-out gain over training time"):md.index("## Promotion")]
    assert "`marft-lg demo-curve RUN_DIR` (RUN_DIR: the folder" in section
    assert "curve.png" not in section
    assert max(map(len, section.splitlines())) <= 80  # the report reads in a terminal


def test_a_curve_that_never_got_significant_says_so(tmp_path):
    from marft_lg.demo import render_report

    summary = {**_summary(), "curve": {"every": 2, "checkpoints": CHECKPOINTS[:1], "minutes_to_significant_gain": None}}
    assert "first significant gain: none of these checkpoints" in render_report(tmp_path, summary).read_text()


def test_the_plot_is_a_png_with_one_line_per_run(tmp_path):
    runs = [{"seed": 0, "run_dir": "runs/a", "checkpoints": CHECKPOINTS},
            {"seed": 1, "run_dir": "runs/b", "checkpoints": [{**CHECKPOINTS[0], "mean": None}]}]  # nothing to draw
    path = dc.plot(runs, tmp_path / "sub" / "curve.png", goal_minutes=8.0)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_evaluate_run_refuses_an_unfinished_run(tmp_path):
    with pytest.raises(ValueError, match="not a finished demo run"):
        dc.evaluate_run(tmp_path)
