"""Counterfactual replay of one step (`serving.replay`, `graph.replays`): the calls before the step are answered from
the record, the step is drawn again, the rest runs on; replays are traced as replays and never mined as production
data; a replay whose upstream does not repeat is marked diverged. Through TeamChatModel (a fake engine on several
topologies, and the tiny model) and plain ChatOpenAI against the loopback server, streaming included."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from chatopenai_apps import chat, two_step
from graph_apps import critic_loop, fan_out, linear
from graph_fakes import FakeEngine

from marft_lg import mine, wrap
from marft_lg.graph import TeamChatModel
from marft_lg.graph.collect import GraphCollector
from marft_lg.graph.replays import ReplayBudget, plan_replays, sibling_returns, step_order
from marft_lg.serving.team import Team
from marft_lg.trajectories.scenarios import Scenario

AGENTS = ("planner", "writer", "critic", "researcher", "synthesizer")


def _acts(ds, eid):
    return ds.actions[ds.actions["episode_id"] == eid].sort_values("order").to_dict("records")


def _check_replays(ds, replayed, jobs):
    """Every replay: held calls identical to the record, the step asked the recorded prompt, metadata as planned."""
    meta = dict(zip(replayed.episodes["episode_id"], replayed.episodes["metadata"], strict=True))
    for job in jobs:
        plan = job.replay
        m = meta[job.episode_id]
        assert m["replay_of"] == plan.episode_id and m["replay_step"] == plan.step and m["replay_diverged"] is None
        assert m["replay_held"] == len(plan.held)
        got = _acts(replayed, job.episode_id)
        orig = {a["order"]: a for a in _acts(ds, plan.episode_id)}
        step = step_order(replayed.actions[replayed.actions["episode_id"] == job.episode_id], plan)
        assert step is not None
        # the held calls are the rows the record answered; a parallel sibling held from the record may start after
        # the replayed step (branches race), so they are matched by content, not by order
        want = Counter((c.agent, tuple(c.completion_ids)) for c in plan.held)
        held = [a for a in got if a["order"] != step
                and want[(a["agent"], tuple(a["completion_token_ids"]))] > 0]
        assert Counter((a["agent"], tuple(a["completion_token_ids"])) for a in held) == want
        for a in held:  # answered from the record: the same completion for the same prompt
            twin = next(o for o in orig.values() if list(o["completion_token_ids"]) == list(a["completion_token_ids"])
                        and o["agent"] == a["agent"])
            assert list(twin["messages"]) == list(a["messages"]) and twin["order"] < plan.step
        step_row = next(a for a in got if a["order"] == step)
        assert step_row["agent"] == plan.agent and list(step_row["messages"]) == list(orig[plan.step]["messages"])


@pytest.mark.parametrize("build", [linear, critic_loop, fan_out])
def test_a_replay_holds_the_upstream_and_draws_the_step_again(tmp_path, build):
    app = wrap(build(TeamChatModel()), team=FakeEngine(agents=AGENTS), trace_dir=tmp_path)
    collector = GraphCollector(app, concurrency=4)
    scenario = Scenario("s", {"msgs": ["go"]})
    ds = collector.collect([scenario], 2, 0, seed=5)
    batch = plan_replays(ds, {"s": scenario}, ReplayBudget(per_action=2), seed=1)
    assert len(batch.jobs) == 2 * len(ds.actions)
    replayed = collector.run(batch.jobs)
    assert not collector.failures
    _check_replays(ds, replayed, batch.jobs)
    # the step itself is drawn again (a new seed), so at least some steps answer differently
    changed = 0
    for job in batch.jobs:
        step = step_order(replayed.actions[replayed.actions["episode_id"] == job.episode_id], job.replay)
        row = next(a for a in _acts(replayed, job.episode_id) if a["order"] == step)
        changed += list(row["completion_token_ids"]) != list(job.replay.target.completion_ids)
    assert changed == len(batch.jobs)
    app.flush()
    mined = mine(tmp_path)  # replays are the trainer's experiments, never production episodes
    assert sorted(mined.episode_ids) == sorted(ds.episode_ids)


def test_the_recorded_calls_are_not_recomputed(tmp_path):
    engine = FakeEngine(agents=AGENTS)
    app = wrap(linear(TeamChatModel()), team=engine, trace_dir=tmp_path)
    collector = GraphCollector(app)
    scenario = Scenario("s", {"msgs": ["go"]})
    ds = collector.collect([scenario], 2, 0, seed=5)
    last = plan_replays(ds.select(ds.episode_ids[:1]), {"s": scenario}, ReplayBudget(per_action=1, agents=["critic"]),
                        seed=2)
    before = len(engine.requests)
    collector.run(last.jobs)
    assert [r.agent for r in engine.requests[before:]] == ["critic"]  # planner and writer came from the record


def test_an_upstream_that_does_not_repeat_marks_the_replay_diverged(tmp_path):
    from graph_apps import State
    from langgraph.graph import END, START, StateGraph

    clock = itertools.count()
    llm = TeamChatModel()

    def planner(state):  # reads something outside the record (a clock, a tool with fresh results)
        return {"msgs": [llm.invoke(f"planner at {next(clock)}: {state['msgs'][-1]}").content]}

    def writer(state):
        return {"msgs": [llm.invoke(f"writer: {state['msgs'][-1]}").content]}

    g = StateGraph(State)
    g.add_node("planner", planner)
    g.add_node("writer", writer)
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    app = wrap(g.compile(), team=FakeEngine(agents=AGENTS), trace_dir=tmp_path)
    collector = GraphCollector(app)
    scenario = Scenario("s", {"msgs": ["go"]})
    ds = collector.collect([scenario], 2, 0, seed=5)
    batch = plan_replays(ds, {"s": scenario}, ReplayBudget(per_action=1, agents=["writer"]), seed=1)
    replayed = collector.run(batch.jobs)
    meta = list(replayed.episodes["metadata"])
    assert meta and all("upstream did not repeat" in m["replay_diverged"] for m in meta)
    usable, lost = sibling_returns(replayed, {e: 1.0 for e in replayed.episode_ids},
                                   {j.episode_id: j.replay for j in batch.jobs})
    assert usable == {} and lost["diverged"] == len(batch.jobs)


def test_steps_after_tool_calls_are_not_replayed_unless_asked(tmp_path):
    import tool_apps as T

    app = wrap(T.hand_written_supervisor(T.ToolFake()), trace_dir=tmp_path)
    collector = GraphCollector(app)
    scenario = Scenario("s", {"messages": [("user", "solve it")]})
    ds = collector.collect([scenario], 2, 0, seed=5)
    tools = [bool(t) for t in ds.actions["tool_calls"]]
    assert any(tools)
    refused = plan_replays(ds, {"s": scenario}, ReplayBudget(per_action=1), seed=1)
    rerun = plan_replays(ds, {"s": scenario}, ReplayBudget(per_action=1, tools="rerun"), seed=1)
    assert refused.skipped["upstream_tool_calls"] > 0
    assert len(rerun.jobs) == len(ds.actions) == len(refused.jobs) + refused.skipped["upstream_tool_calls"]
    unknown = plan_replays(ds, {}, ReplayBudget(per_action=1), seed=1)  # no scenario: no input to replay from
    assert unknown.jobs == [] and unknown.skipped["no_scenario"] == len(ds)


@pytest.fixture()
def tiny_team(tiny_model_dir, tmp_path):
    team = Team(tiny_model_dir, ["planner", "writer", "critic"], registry=tmp_path / "registry", versions=None, seed=0)
    yield team
    team.close()


def _same_upstream_on_tokens(ds, replayed, jobs):
    """On a real engine the held calls repeat token for token: the same prompt ids and completion ids."""
    for job in jobs:
        plan = job.replay
        got = _acts(replayed, job.episode_id)
        step = step_order(replayed.actions[replayed.actions["episode_id"] == job.episode_id], plan)
        orig = _acts(ds, plan.episode_id)
        for a, o in zip(got[:step], orig[:plan.step], strict=True):
            assert list(a["prompt_token_ids"]) == list(o["prompt_token_ids"])
            assert list(a["completion_token_ids"]) == list(o["completion_token_ids"])
            assert list(a["completion_logprobs"]) == list(o["completion_logprobs"])
        assert list(got[step]["prompt_token_ids"]) == list(orig[plan.step]["prompt_token_ids"])
        assert list(got[step]["completion_token_ids"]) != list(orig[plan.step]["completion_token_ids"])
        assert got[step]["adapter_version"] == orig[plan.step]["adapter_version"]


def test_team_chat_model_replays_on_the_tiny_model_token_for_token(tiny_team, tmp_path):
    app = wrap(linear(TeamChatModel(max_tokens=6)), team=tiny_team, trace_dir=tmp_path)
    collector = GraphCollector(app)
    scenario = Scenario("s", {"msgs": ["go"]})
    ds = collector.collect([scenario], 1, 0, seed=5)
    batch = plan_replays(ds, {"s": scenario}, ReplayBudget(per_action=1, agents=["writer", "critic"]), seed=1)
    replayed = collector.run(batch.jobs)
    _same_upstream_on_tokens(ds, replayed, batch.jobs)
    app.close()


@pytest.mark.parametrize("streaming", [False, True])
def test_chatopenai_apps_replay_through_the_loopback_server(tiny_team, tmp_path, streaming):
    app = wrap(two_step(chat("planner", max_tokens=6, streaming=streaming),
                        chat("writer", max_tokens=6, streaming=streaming)),
               team=tiny_team, trace_dir=tmp_path, serve_http=True)
    collector = GraphCollector(app)
    scenario = Scenario("s", {"question": "Where is Paris?"})
    ds = collector.collect([scenario], 1, 0, seed=5)
    assert all(len(p) > 0 for p in ds.actions["prompt_token_ids"])  # the server's own record
    batch = plan_replays(ds, {"s": scenario}, ReplayBudget(per_action=2, agents=["writer"]), seed=1)
    replayed = collector.run(batch.jobs)
    assert not collector.failures
    _same_upstream_on_tokens(ds, replayed, batch.jobs)
    assert all(m["replay_diverged"] is None for m in replayed.episodes["metadata"])
    app.close()


def test_a_parallel_branch_asked_before_the_step_is_not_a_divergence():
    from marft_lg.serving.replay import RecordedCall, ReplayPlan, ReplayState

    def call(order, agent, prompt):
        return RecordedCall(order, agent, (prompt,), None, (order + 100,), (-0.5,), f"t{order}")

    planner, w1, w2, critic = call(0, "planner", 1), call(1, "writer", 2), call(2, "writer", 3), call(3, "critic", 4)
    plan = ReplayPlan("e", step=1, agent="writer", held=(planner,), target=w1, later=(w2, critic))
    state = ReplayState(plan)
    assert state.route("planner", [1], None) is planner  # held: from the record
    assert state.route("writer", [3], None) == "free"  # the other Send branch arrived first: it is not upstream
    assert state.route("writer", [2], None) == "step"
    assert state.outcome()["replay_diverged"] is None
    other = ReplayState(plan)
    assert other.route("planner", [9], None) == "free"  # a planner prompt nobody recorded: the upstream changed
    assert "upstream did not repeat" in other.outcome()["replay_diverged"]
    missing = ReplayState(plan)
    assert missing.route("writer", [2], None) == "step"  # the planner's recorded call never came again
    assert "not asked again" in missing.outcome()["replay_diverged"]
