"""Shadow (mirrored) runs are a candidate's answers, never a user's: production mining leaves them out and counts
them; the readers of mirrored pairs (`compare_mirrored`, `WrappedGraph.capture`) still get both sides."""

from __future__ import annotations

from graph_apps import linear
from graph_fakes import FakeEngine

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.rewards.composite import CompositeReward
from marft_lg.trajectories.mining import mine, mine_with_report


def _mirrored_app(trace_dir):
    return wrap(linear(TeamChatModel()), team=FakeEngine(versions={"planner": "v1", "writer": "v1", "critic": "v1"}),
                trace_dir=trace_dir, shadow={"writer": "v2"}, sample_rate=1.0)


def test_mirrored_runs_are_not_mined_as_production_and_are_counted(tmp_path):
    app = _mirrored_app(tmp_path / "traces")
    with app.capture() as captured:
        for i in range(4):
            app.invoke({"msgs": [f"q{i}"]}, seed=i, episode_id=f"user-{i}", scenario_id=f"s{i}")
        assert app.wait_for_shadows(30)
    assert app.flush()

    ds, report = mine_with_report(tmp_path / "traces")
    assert sorted(ds.episode_ids) == [f"user-{i}" for i in range(4)]  # what the users got, nothing else
    assert report.shadows == 4 and report.episodes == 4
    assert set(ds.actions["adapter_version"]) == {"v1"}

    both = mine(tmp_path / "traces", keep_shadows=True)
    assert len(both) == 8 and {f"user-{i}-shadow" for i in range(4)} <= set(both.episode_ids)
    assert len(captured.dataset()) == 8  # the app's own reading of what it ran keeps the mirrors

    result = compare_mirrored_on(tmp_path / "traces")
    assert result.meta["pairs_tagged"] == 4
    assert result.meta["candidate"]["writer"] == ["v2"] and result.meta["baseline"]["writer"] == ["v1"]
    app.close()


def compare_mirrored_on(trace_dir):
    from marft_lg.evaluation.shadow import compare_mirrored

    return compare_mirrored(trace_dir, CompositeReward.from_yaml({"weights": {"step_count": -1.0}}), n_resamples=50)
