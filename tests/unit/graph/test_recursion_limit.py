"""A step cap on the app's runs (`wrap(..., recursion_limit=)`, `AppSpec.recursion_limit`, train.yaml
`online.recursion_limit`): a looping graph stops there as a truncated episode (traced, read back, not a failure), a
prebuilt ReAct agent ends its tool loop near it and answers; through TeamChatModel and plain ChatOpenAI."""

from __future__ import annotations

import pytest
from chatopenai_apps import chat, scripted
from graph_apps import critic_loop
from graph_fakes import FakeEngine
from langgraph.errors import GraphRecursionError

from marft_lg import wrap
from marft_lg.distributed.worker import WorkerSpec
from marft_lg.evaluation.commands import _replay_spec
from marft_lg.graph import TeamChatModel
from marft_lg.graph.app_spec import AppSpec
from marft_lg.graph.collect import GraphCollector, plan_episodes
from marft_lg.serving.team import Team
from marft_lg.training.commands import TrainFile
from marft_lg.trajectories.scenarios import Scenario

ADD = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
QUESTION = {"messages": [{"role": "user", "content": "What is 1 plus 2?"}]}


def _endless(llm):
    return critic_loop(llm, max_rounds=10**9)  # writer <-> critic, never done


def test_a_looping_app_stops_at_the_limit_as_a_truncated_episode(tmp_path):
    app = wrap(_endless(TeamChatModel()), team=FakeEngine(agents=("writer", "critic")), trace_dir=tmp_path,
               recursion_limit=6)
    collector = GraphCollector(app, concurrency=2)
    jobs = plan_episodes("cap", [Scenario("s", {"msgs": ["go"]})], 2, 0, seed=1)
    ds = collector.run(jobs)
    assert collector.failures == [] and sorted(collector.truncated) == sorted(j.episode_id for j in jobs)
    assert sorted(ds.episode_ids) == sorted(j.episode_id for j in jobs)  # traced and read back, steps and all
    assert set(ds.episodes["n_actions"]) == {6}
    assert set(ds.actions["agent"]) == {"writer", "critic"}
    # a run's own limit wins over the app's; streaming stops at it too
    with app.capture() as captured:
        with pytest.raises(GraphRecursionError):
            app.invoke({"msgs": ["go"]}, {"recursion_limit": 3}, episode_id="own")
        with pytest.raises(GraphRecursionError):
            list(app.stream({"msgs": ["go"]}, episode_id="streamed"))
    got = captured.dataset(["own", "streamed"])
    assert dict(zip(got.episodes["episode_id"], got.episodes["n_actions"], strict=True)) == {"own": 3, "streamed": 6}
    app.close()


def test_limits_are_checked_and_reach_every_app_built_from_a_spec(tmp_path):
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(ValueError, match="recursion_limit must be a whole number >= 1"):
            wrap(_endless(TeamChatModel()), trace_dir=None, recursion_limit=bad)
    engine = FakeEngine(agents=("writer", "critic"))
    spec = AppSpec(app=_endless, agents=["writer", "critic"], recursion_limit=9)
    app = spec.build_app(engine, None)
    assert app.recursion_limit == 9
    app.close()
    # a WrappedGraph given as the app keeps its own limit unless the spec sets one
    inner = wrap(_endless(TeamChatModel(team=engine)), trace_dir=None, recursion_limit=4)
    assert AppSpec(app=inner, agents=["writer"]).build_app(engine, None).recursion_limit == 4
    assert AppSpec(app=inner, agents=["writer"], recursion_limit=12).build_app(engine, None).recursion_limit == 12
    spec = AppSpec(app="graph_apps:critic_loop", agents=["writer"], recursion_limit=7)
    assert WorkerSpec.of(spec).app_spec().recursion_limit == 7  # Ray rollout workers build theirs with it
    spec, _ = _replay_spec("graph_apps:critic_loop", "m", "writer,critic", None, None, 16, 1.0, 5)
    assert spec.recursion_limit == 5  # `marft-lg compare/attribute --recursion-limit`
    yaml = tmp_path / "train.yaml"
    yaml.write_text("agents: [writer]\nreward: {weights: {step_count: -0.1}}\nphases: [online]\nscenarios: s.jsonl\n"
                    "online: {app: 'graph_apps:critic_loop', recursion_limit: 11}\n")
    assert TrainFile.load(yaml).app_spec().recursion_limit == 11


@pytest.fixture()
def team(tiny_model_dir, tmp_path):
    t = Team(tiny_model_dir, ["alice"], registry=tmp_path / "registry", versions=None, seed=0)
    t.load_version("alice", t.save_version("alice"))
    yield t
    t.close()


def _react_on_chatopenai():
    """A prebuilt ReAct agent on its own ChatOpenAI (nothing of marft_lg inside) that always calls a tool."""
    import warnings

    from chatopenai_apps import add
    from langgraph.prebuilt import create_react_agent

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return create_react_agent(chat("alice"), [add], prompt="You add numbers with the add tool.", name="alice")


def test_a_prebuilt_agent_on_chatopenai_ends_its_tool_loop_at_the_limit(team, tmp_path):
    scripted(team, {"alice": [ADD]})  # the model never stops calling the tool
    app = AppSpec(app=_react_on_chatopenai, agents=["alice"], recursion_limit=8).build_app(team, tmp_path / "traces")
    collector = GraphCollector(app, concurrency=2)
    jobs = plan_episodes("react", [Scenario("q", QUESTION)], 2, 0, seed=3)
    ds = collector.run(jobs)
    assert collector.failures == [] and collector.truncated == []  # LangGraph's agent answered instead
    assert len(ds) == 2 and set(ds.episodes["n_actions"]) == {4}  # (agent, tools) x 4 within 8 steps
    assert all("need more steps" in (o or "") for o in ds.episodes["outcome"])
    assert app.server.redirected == 8  # every call reached the team through the loopback server
    chunks = list(app.stream(QUESTION, episode_id="streamed", stream_mode="updates"))
    assert "need more steps" in str(chunks[-1])
    # an odd limit leaves the agent one step short of answering (LangGraph's own count): the runner keeps the
    # episode as truncated
    app.recursion_limit = 7
    ds = collector.run(plan_episodes("odd", [Scenario("q", QUESTION)], 1, 0, seed=3))
    assert collector.failures == [] and len(collector.truncated) == 1 and list(ds.episodes["n_actions"]) == [4]
    app.close()


LOOP_APP = '''
from typing import TypedDict

from langgraph.graph import START, StateGraph


class S(TypedDict):
    n: int


g = StateGraph(S)
g.add_node("tick", lambda s: {"n": s["n"] + 1})
g.add_edge(START, "tick")
g.add_conditional_edges("tick", lambda s: "tick", ["tick"])  # never ends
graph = g.compile()
'''


def test_marft_lg_run_keeps_going_past_runs_stopped_at_the_limit(tmp_path):
    from typer.testing import CliRunner

    from marft_lg.cli import app as cli
    from tests.cli_text import flat

    (tmp_path / "loop.py").write_text(LOOP_APP)
    (tmp_path / "s.jsonl").write_text('{"scenario_id": "a", "inputs": {"n": 0}}\n')
    out = CliRunner().invoke(cli, ["run", "--app", f"{tmp_path / 'loop.py'}:graph", "--scenarios",
                                   str(tmp_path / "s.jsonl"), "--trace-dir", str(tmp_path / "traces"),
                                   "--samples", "2", "--recursion-limit", "5"])
    assert out.exit_code == 0, out.output
    assert "ran 2 episodes (0 failed, 2 stopped at the recursion limit)" in flat(out.output)
    assert list((tmp_path / "traces").glob("*.jsonl"))


def test_marft_lg_run_names_failed_runs_and_exits_1_when_all_failed(tmp_path):
    from typer.testing import CliRunner

    from marft_lg.cli import app as cli
    from tests.cli_text import flat

    (tmp_path / "boom.py").write_text(LOOP_APP.replace('lambda s: {"n": s["n"] + 1}', "lambda s: 1 / 0"))
    (tmp_path / "s.jsonl").write_text('{"scenario_id": "a", "inputs": {"n": 0}}\n')
    out = CliRunner().invoke(cli, ["run", "--app", f"{tmp_path / 'boom.py'}:graph", "--scenarios",
                                   str(tmp_path / "s.jsonl"), "--trace-dir", str(tmp_path / "traces")])
    text = flat(out.output)
    assert out.exit_code == 1 and "ran 1 episodes (1 failed) of 1 scenarios" in text
    assert "failed run-" in text and "-a-0: ZeroDivisionError: division by zero" in text
