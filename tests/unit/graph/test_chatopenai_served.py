"""Apps on plain ChatOpenAI, unchanged: the server's record of what it sampled is what mining and training use,
tool calls are actions (their errors counted whichever client made them), and on-policy / comparison replays reach
the versions under test through the app's own chat models (tiny model, scripted completion texts)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from chatopenai_apps import HANDOFF, UNKNOWN_TOOL, chat, external, scripted, swarm, two_step
from langchain_core.messages import HumanMessage
from pydantic import BaseModel

from marft_lg.graph.app_spec import AppSpec
from marft_lg.graph.collect import RolloutError
from marft_lg.graph.wrap import wrap
from marft_lg.serving.http.local_server import LocalServer
from marft_lg.serving.team import Team
from marft_lg.tracing import attributes as A
from marft_lg.tracing.sink import make_record_sink
from marft_lg.training.buffer import _prompt_ids, build_buffer
from marft_lg.trajectories.mining import mine_with_report
from marft_lg.trajectories.scenarios import Scenario

QUESTION = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}]}


@pytest.fixture()
def team(tiny_model_dir, tmp_path):
    t = Team(tiny_model_dir, ["alice", "bob"], registry=tmp_path / "registry", versions=None, seed=0)
    for role in ("alice", "bob"):
        t.load_version(role, t.save_version(role))  # both serve v1
    yield t
    t.close()


@pytest.fixture()
def served(team, tmp_path):
    """`marft-lg serve` in this process: the team behind a loopback server that records into its own folder."""
    sink = make_record_sink(tmp_path / "server", file_prefix="served")
    server = LocalServer(team, sink)
    yield server, sink
    server.close()
    sink.shutdown()


def _run_by_thread_id(app) -> None:
    """The app driven as its users drive it: `stream` and `astream_events`, each conversation by its thread id."""
    list(app.stream(QUESTION, {"configurable": {"thread_id": "desk-1"}}, stream_mode="updates"))

    async def events():
        return [e async for e in app.astream_events(QUESTION, {"configurable": {"thread_id": "desk-2"}}, version="v2")]

    assert any(e["event"] == "on_chat_model_end" for e in asyncio.run(events()))


def test_a_swarm_on_chatopenai_is_mined_with_what_the_server_sampled(team, served, tmp_path):
    server, sink = served
    requests = scripted(team, {"alice": [HANDOFF], "bob": [UNKNOWN_TOOL]})
    app = wrap(swarm(server.base_url), trace_dir=tmp_path / "app")  # no team: the app talks to the server itself
    _run_by_thread_id(app)
    app.flush()
    sink.flush()

    alone, alone_report = mine_with_report([tmp_path / "app"])  # what the app's own spans hold: no ids
    assert set(alone.actions["completion"][alone.actions["agent"] == "alice"]) == {""}
    assert alone_report.actions_without_token_ids == {"alice": 2, "bob": 2}

    ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"])
    assert report.served_merged == 4 and report.actions_without_token_ids == {}
    assert len(ds) == 2 and sorted(ds.episodes["n_actions"]) == [2, 2]
    acts = ds.actions
    engine = team.engine
    rendered = sorted(tuple(engine.encode(r)) for r in requests)
    assert sorted(tuple(p) for p in acts["prompt_token_ids"]) == rendered  # exactly the server's rendering
    tok = team.tokenizer
    for row in acts.to_dict("records"):
        assert len(row["completion_logprobs"]) == len(row["completion_token_ids"]) > 0
        assert row["adapter_version"] == "v1"
        assert "transfer_to_" in tok.decode(row["prompt_token_ids"])  # the tools block the server rendered
        assert list(row["prompt_token_ids"]) != _prompt_ids(row, tok)  # which a re-render from messages lacks
    alice = acts[acts["agent"] == "alice"].to_dict("records")
    assert {r["completion"] for r in alice} == {HANDOFF}  # a tool-call-only completion is an action with its text
    assert all(list(r["completion_token_ids"]) == tok(HANDOFF, add_special_tokens=False)["input_ids"] for r in alice)
    assert all([(c["name"], c["error"]) for c in r["tool_calls"]] == [("transfer_to_bob", None)] for r in alice)
    bob = acts[acts["agent"] == "bob"].to_dict("records")
    assert all(r["tool_errors"] == 1 for r in bob)  # ChatOpenAI dropped the server's invalid_tool_calls
    assert all("unknown tool 'teleport'" in r["tool_calls"][0]["error"] for r in bob)

    rewards = {eid: np.zeros(2) for eid in ds.episode_ids}
    buffer = build_buffer(ds, rewards, tok, max_context=4096)
    assert len(buffer.records) == 4 and not buffer.skipped and not buffer.retokenised  # hand-offs are trained
    app.close()


def test_on_policy_runs_the_app_as_it_is_on_the_adapters_being_trained(team, tmp_path):
    from marft_lg.rewards.composite import CompositeReward
    from marft_lg.training.config import MARFTConfig
    from marft_lg.training.trainer import MARFTTrainer

    scripted(team, {"alice": [HANDOFF, "It is 5."], "bob": ["Sunny."]})
    spec = AppSpec(app="chatopenai_apps:build_swarm", agents=["alice", "bob"], base_dir=str(_here()))
    assert spec.check_app() == "factory"  # called with no argument: its own ChatOpenAI per agent
    wrapped = spec.build_app(team, tmp_path / "traces")
    cfg = MARFTConfig(group_size=2, update_scheme="simultaneous", learning_rate=1e-2, plots=False, seed=1,
                      rollout_concurrency=2, behaviour_logprobs="recompute")  # the scripted texts' are made up
    reward = CompositeReward.from_yaml({"weights": {"step_count": -1.0}})  # the hand-off costs a step
    trainer = MARFTTrainer(team, reward, cfg, tmp_path / "run", progress=False)
    before = [p.detach().clone() for p in _adapter(team, "alice")]
    [row] = trainer.fit_online(wrapped, [Scenario("paris", QUESTION)], iterations=1)
    wrapped.close()
    assert wrapped.server.redirected == 3  # the app's URL answers nothing: every call reached the team
    assert row["episodes"] == 2 and row["retokenised"] == {} and trainer.update_steps["alice"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, _adapter(team, "alice"), strict=True))
    ds, _ = mine_with_report([tmp_path / "traces"])
    alice = ds.actions[ds.actions["agent"] == "alice"]
    assert set(alice["completion"]) == {HANDOFF, "It is 5."} and set(ds.actions["adapter_version"]) == {"v1"}


def test_compare_replays_each_side_on_its_versions_and_fails_loudly_when_calls_miss_the_team(team, tmp_path):
    from marft_lg.evaluation.shadow import shadow_compare
    from marft_lg.rewards.composite import CompositeReward

    scripted(team, {"alice": [HANDOFF], "bob": ["Sunny."]})
    team.save_version("alice")  # v2
    reward = CompositeReward.from_yaml({"weights": {"step_count": -0.1}})
    scenarios = [Scenario("paris", QUESTION), Scenario("rome", {"messages": [{"role": "user", "content": "Rome?"}]})]
    wrapped = AppSpec(app=swarm, agents=["alice", "bob"]).build_app(team, tmp_path / "traces")
    result = shadow_compare(wrapped, {"alice": "v1", "bob": "v1"}, {"alice": "v2"}, scenarios, reward,
                            samples_per_scenario=2, drift=False, progress=False)
    wrapped.close()
    for side, version in (("baseline", "v1"), ("candidate", "v2")):
        acts = result.datasets[side].actions
        assert len(result.datasets[side]) == 4
        assert set(acts["adapter_version"][acts["agent"] == "alice"]) == {version}
        assert set(acts["adapter_version"][acts["agent"] == "bob"]) == {"v1"}

    def external_writer():  # the writer node asks a hosted model, not the team's role it is mapped to
        return two_step(chat("alice"), external("gpt-4o-mini"))

    wrapped = AppSpec(app=external_writer, agents=["alice", "bob"], node_roles={"planner": "alice", "writer": "bob"}
                      ).build_app(team, tmp_path / "traces2")
    with pytest.raises(RolloutError, match=r"2 of 4 actions of the team's roles were not answered by the versions "
                                           r"under test .*bob answered by nothing the team served, expected v1"):
        shadow_compare(wrapped, {"alice": "v1"}, {"alice": "v2"}, [Scenario("q", {"question": "hi"})], reward,
                       drift=False, progress=False)
    wrapped.close()


class Facts(BaseModel):
    facts: list[str]


def _raising_planner_run(team, tmp_path, episode_id: str, **llm):
    """planner -> writer where the planner's structured call gets text that is not JSON and the app catches the
    parse error, as apps do; returns the episode read back and the errors the app caught."""
    scripted(team, {"alice": ["not json at all"], "bob": ["done"]})
    structured = chat("alice", **llm).with_structured_output(Facts, method="json_schema")
    caught: list[BaseException] = []

    class Planner:
        def invoke(self, messages):
            try:
                return structured.invoke(messages)
            except Exception as e:  # noqa: BLE001
                caught.append(e)
                return HumanMessage("no facts")

    wrapped = AppSpec(app=lambda: two_step(Planner(), chat("bob")), agents=["alice", "bob"],
                      node_roles={"planner": "alice", "writer": "bob"}).build_app(team, tmp_path / "traces")
    with wrapped.capture() as captured:
        wrapped.invoke({"question": "Name two facts about Paris."}, episode_id=episode_id)
    wrapped.close()
    return captured.dataset(), caught


def test_a_call_that_raises_keeps_its_sampled_text(team, tmp_path):
    ds, caught = _raising_planner_run(team, tmp_path, "raised")
    acts = ds.actions
    planner = acts[acts["agent"] == "alice"].iloc[0]
    rows = acts[["agent", "completion", "adapter_version", "model"]].to_dict("records")
    assert planner["completion"] == "not json at all" and len(planner["completion_token_ids"]) > 0, (caught, rows)
    assert planner["adapter_version"] == "v1" and len(acts) == 2


def test_a_checkpointed_app_gets_a_thread_per_episode(team, tmp_path):
    scripted(team, {"alice": ["It is 5."], "bob": ["Sunny."]})
    wrapped = AppSpec(app=swarm, agents=["alice", "bob"]).build_app(team, tmp_path / "traces")
    first = wrapped.invoke(QUESTION, episode_id="e1")  # no thread id given: the episode's own
    second = wrapped.invoke(QUESTION, episode_id="e2")
    assert len(first["messages"]) == len(second["messages"]) == 2  # nothing carried over between episodes
    assert wrapped.get_state({"configurable": {"thread_id": "e2"}}).values["messages"][-1].content == "It is 5."
    wrapped.close()


def test_the_servers_span_is_a_child_of_the_apps_and_carries_the_episode(team, served, tmp_path):
    server, sink = served
    scripted(team, {"alice": ["It is 5."], "bob": ["Sunny."]})
    app = wrap(swarm(server.base_url), trace_dir=tmp_path / "app")
    with app.capture() as app_spans, sink.tap() as server_spans:
        app.invoke(QUESTION, episode_id="paired-a", seed=7)
        app.invoke(QUESTION, episode_id="paired-b", seed=7)
        chat("alice", server.base_url).invoke("outside any episode")
    chats = {(s.trace_id, s.span_id): s for s in app_spans.spans if s.name.startswith("chat ")}
    inside = [s for s in server_spans if s.attributes.get(A.MARFT_EPISODE_ID)]
    assert len(inside) == 2 and all((s.trace_id, s.parent_id) in chats for s in inside)
    assert {s.attributes[A.MARFT_EPISODE_ID] for s in inside} == {"paired-a", "paired-b"}
    assert len({s.attributes[A.GEN_AI_REQUEST_SEED] for s in inside}) == 1  # same episode seed, same call seed
    [outside] = [s for s in server_spans if not s.attributes.get(A.MARFT_EPISODE_ID)]
    assert outside.parent_id == 0 and A.GEN_AI_REQUEST_SEED not in outside.attributes
    app.close()


def test_an_apps_own_traceparent_is_kept_and_the_response_id_joins(team, served, tmp_path):
    server, sink = served
    scripted(team, {"alice": ["It is 5."], "bob": ["Sunny."]})
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    llm = chat("alice", server.base_url, default_headers={"traceparent": theirs})
    app = wrap(two_step(llm, chat("bob", server.base_url)), trace_dir=tmp_path / "app")
    app.invoke({"question": "hi"}, episode_id="own-otel")
    app.flush()
    sink.flush()
    ds, report = mine_with_report([tmp_path / "app", tmp_path / "server"])
    assert report.served_merged == 2 and len(ds) == 1  # the planner's joined by its response id
    assert all(len(p) > 0 for p in ds.actions["prompt_token_ids"])
    app.close()


def test_a_raising_call_under_the_apps_own_traceparent_still_joins_its_record(team, tmp_path):
    """An app with OTel instrumentation of its own (OpenLLMetry injects its span as ``traceparent``) whose structured
    call raises: its LLM span never saw a response id, so only our span id, carried in the baggage, joins the
    server's record of what was sampled (before: an empty action plus the record as a duplicate action)."""
    theirs = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    ds, caught = _raising_planner_run(team, tmp_path, "theirs-raised", default_headers={"traceparent": theirs})
    acts = ds.actions
    assert list(acts["agent"]) == ["alice", "bob"], acts[["agent", "completion"]].to_dict("records")
    assert acts["completion"].iloc[0] == "not json at all" and len(acts["completion_token_ids"].iloc[0]) > 0
    assert bool(ds.episodes["settled"].iloc[0]) and len(caught) == 1


def test_node_roles_naming_no_node_of_the_app_is_refused(team, tmp_path):
    from marft_lg._config import ConfigError

    spec = AppSpec(app=lambda: two_step(chat("alice"), chat("bob")), agents=["alice", "bob"],
                   node_roles={"planer": "alice"}, source="train.yaml:9", what="online.app")
    with pytest.raises(ConfigError, match=r"train.yaml:9: online.app .*node_roles names 'planer', which is not a "
                                          r"node of the app \(its nodes: \['planner', 'writer'\]\)"):
        spec.build_app(team, tmp_path / "traces")


def _here():
    from pathlib import Path

    return Path(__file__).parent


def _adapter(team, role):
    from marft_lg.training.policy import adapter_parameters

    return adapter_parameters(team.model, team.adapter_name(role))
