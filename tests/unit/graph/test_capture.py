"""A wrapped app hands back the episodes it just ran (`WrappedGraph.capture`) equal, column by column, to mining the
trace files those same spans were exported to: tool calls, tool errors, token ids and log-probs included."""

from __future__ import annotations

import pandas as pd
import pytest
import tool_apps as T
from graph_apps import critic_loop, fan_out, linear, with_subgraph
from graph_fakes import FakeEngine

from marft_lg import mine, wrap
from marft_lg.graph import TeamChatModel
from marft_lg.training.rollout import GraphCollector
from marft_lg.trajectories.scenarios import Scenario

INPUT = {"messages": [("user", "solve it")]}
TOOL_APPS = ["hand_written_supervisor", "prebuilt_supervisor", "swarm", "nested_custom", "send_fan_out"]


def _same(captured, mined) -> None:
    assert len(captured.episodes) == len(mined.episodes) > 0
    for name in ("episodes", "actions"):
        a = getattr(captured, name).reset_index(drop=True)
        b = getattr(mined, name).reset_index(drop=True)
        assert list(a.columns) == list(b.columns)
        for column in a.columns:
            pd.testing.assert_series_equal(a[column], b[column], check_exact=True, obj=f"{name}.{column}")


@pytest.mark.parametrize("topology", TOOL_APPS)
def test_captured_tool_apps_equal_their_mined_files(tmp_path, topology):
    app = wrap(getattr(T, topology)(T.ToolFake()), trace_dir=tmp_path)
    with app.capture() as captured:
        for i in range(3):
            app.invoke(INPUT, episode_id=f"e{i}", scenario_id=f"s{i}")
    app.flush()
    dataset, mined = captured.dataset(), mine(tmp_path)
    _same(dataset, mined)
    if topology == "hand_written_supervisor":  # the raising divide: failed tool calls survive the trip
        assert dataset.actions["tool_errors"].sum() > 0
    if topology in ("hand_written_supervisor", "prebuilt_supervisor", "swarm"):
        assert dataset.actions["tool_calls"].map(len).sum() > 0


@pytest.mark.parametrize("build", [linear, critic_loop, fan_out, with_subgraph])
def test_captured_team_runs_keep_token_ids_and_logprobs(tmp_path, build):
    app = wrap(build(TeamChatModel()), team=FakeEngine(agents=("planner", "writer", "critic", "researcher",
                                                               "synthesizer", "inner", "sub")), trace_dir=tmp_path)
    with app.capture() as captured:
        app.batch([{"msgs": ["a"]}, {"msgs": ["b"]}], episode_ids=["b0", "b1"])
    app.flush()
    dataset = captured.dataset()
    _same(dataset, mine(tmp_path))
    assert dataset.actions["completion_token_ids"].map(lambda v: v is not None and len(v) > 0).all()
    assert dataset.actions["completion_logprobs"].map(lambda v: v is not None and len(v) > 0).all()


def test_capture_holds_only_the_runs_inside_it(tmp_path):
    app = wrap(T.nested_custom(T.ToolFake()), trace_dir=tmp_path)
    app.invoke(INPUT, episode_id="before")
    with app.capture() as captured:
        app.invoke(INPUT, episode_id="inside")
    app.invoke(INPUT, episode_id="after")
    assert captured.dataset().episode_ids == ["inside"]
    assert captured.dataset(["inside", "missing"]).episode_ids == ["inside"]


def test_the_collector_reads_no_trace_file(tmp_path, monkeypatch):
    from marft_lg.trajectories import mining

    app = wrap(T.nested_custom(T.ToolFake()), trace_dir=tmp_path)
    monkeypatch.setattr(mining, "trace_files", lambda *a, **k: pytest.fail("the collector read trace files"))
    collector = GraphCollector(app, run_id="r")
    dataset = collector.collect([Scenario("s1", INPUT), Scenario("s2", INPUT)], k=2, iteration=3, seed=0)
    assert sorted(dataset.episode_ids) == sorted(f"r-it3-s{s}-{j}" for s in (1, 2) for j in range(2))
