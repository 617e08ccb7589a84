"""Tutorial-style apps, unchanged: every entry point traced once per run, prebuilt agents as roles, steps and
dependencies right across subgraphs, malformed tool calls counted as tool errors."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import tool_apps as T
from graph_fakes import FakeEngine
from langchain_core.runnables import Runnable, RunnableLambda

from marft_lg import mine, wrap
from marft_lg.graph import TeamChatModel

INPUT = {"messages": [("user", "solve it")]}
TOPOLOGIES = {
    "hand_written_supervisor": (T.hand_written_supervisor, {"supervisor", "researcher", "mathematician"}),
    "prebuilt_supervisor": (T.prebuilt_supervisor, {"supervisor", "researcher", "mathematician"}),
    "swarm": (T.swarm, {"researcher", "mathematician"}),
    "nested_custom": (T.nested_custom, {"planner", "team|drafter", "team|editor", "critic"}),
    "send_fan_out": (T.send_fan_out, {"planner", "worker", "synthesizer"}),
}


def _entry_points(app: Runnable) -> dict[str, object]:
    """Run the app once through every entry point; episode ids by entry point."""
    runs: dict[str, object] = {}

    def cfg(eid: str) -> dict:
        return {"metadata": {"episode_id": eid}}

    runs["invoke"] = app.invoke(INPUT, episode_id="invoke")
    runs["ainvoke"] = asyncio.run(app.ainvoke(INPUT, episode_id="ainvoke"))
    runs["stream"] = list(app.stream(INPUT, episode_id="stream"))
    runs["stream-modes"] = list(app.stream(INPUT, episode_id="stream-modes", stream_mode=["updates", "messages"],
                                           subgraphs=True))

    async def agen(it):
        return [x async for x in it]

    runs["astream"] = asyncio.run(agen(app.astream(INPUT, episode_id="astream", stream_mode="messages")))
    runs["batch"] = app.batch([INPUT, INPUT], episode_ids=["batch-0", "batch-1"], return_exceptions=True)
    runs["abatch"] = asyncio.run(app.abatch([INPUT, INPUT], [cfg("abatch-0"), cfg("abatch-1")]))
    runs["events"] = asyncio.run(agen(app.astream_events(INPUT, cfg("events"), version="v2")))
    runs["log"] = asyncio.run(agen(app.astream_log(INPUT, cfg("log"))))
    runs["with_config"] = app.with_config(metadata={"episode_id": "with_config"}).invoke(INPUT)
    runs["with_retry"] = app.with_retry(stop_after_attempt=2).invoke(INPUT, cfg("with_retry"))
    ended = []
    runs["with_listeners"] = app.with_listeners(on_end=lambda run: ended.append(run)).invoke(INPUT, cfg("with_listeners"))
    assert len(ended) == 1
    runs["pipe"] = (RunnableLambda(lambda x: x) | app).invoke(INPUT, cfg("pipe"))
    runs["pipe-stream"] = list((RunnableLambda(lambda x: x) | app).stream(INPUT, cfg("pipe-stream")))
    return runs


EXPECTED_IDS = {"invoke", "ainvoke", "stream", "stream-modes", "astream", "batch-0", "batch-1", "abatch-0",
                "abatch-1", "events", "log", "with_config", "with_retry", "with_listeners", "pipe", "pipe-stream"}


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_every_entry_point_records_exactly_one_episode_per_run(tmp_path, topology):
    build, roles = TOPOLOGIES[topology]
    app = wrap(build(T.ToolFake()), trace_dir=tmp_path)
    assert isinstance(app, Runnable)
    runs = _entry_points(app)
    assert all(not isinstance(r, Exception) for r in runs["batch"])
    assert app.flush()
    ds = mine([tmp_path])
    episodes = ds.episodes.set_index("episode_id")
    assert set(episodes.index) == EXPECTED_IDS and len(episodes) == len(EXPECTED_IDS)
    per_episode = ds.actions.groupby("episode_id").size()
    assert per_episode.nunique() == 1, per_episode.to_dict()  # each run holds the whole run, once
    assert set(ds.actions["agent"]) == roles
    assert (episodes["status"] == "ok").all()


@pytest.mark.parametrize("topology", sorted(TOPOLOGIES))
def test_steps_grow_along_the_run_and_each_agent_depends_on_what_routed_it(tmp_path, topology):
    build, _ = TOPOLOGIES[topology]
    app = wrap(build(T.ToolFake()), trace_dir=tmp_path)
    app.invoke(INPUT, episode_id="e")
    app.flush()
    acts = mine([tmp_path]).actions.sort_values("order").to_dict("records")
    steps = [a["step"] for a in acts]
    assert steps == sorted(steps) and steps[0] == 1
    # every worker's first tool turn wrote one malformed call (and the mathematician's divide by 0 raises)
    expected_errors = {"nested_custom": 0, "swarm": 1, "send_fan_out": 3}.get(topology)
    errors = sum(a["tool_errors"] for a in acts)
    assert errors == expected_errors if expected_errors is not None else errors >= 2, (topology, errors)
    for i, a in enumerate(acts[1:], start=1):
        earlier = acts[:i]
        assert a["depends_on"] and max(a["depends_on"]) < i
        if not any((b["agent"], b["step"]) == (a["agent"], a["step"]) for b in earlier):  # a turn's first call
            previous_step = max(b["step"] for b in earlier if b["step"] < a["step"])
            routed_by = {j for j, b in enumerate(earlier) if b["step"] == previous_step}
            assert routed_by & set(a["depends_on"]), (i, a["agent"], a["depends_on"], routed_by)


def test_every_hand_off_depends_on_the_supervisor_action_that_routed_it(tmp_path):
    app = wrap(T.hand_written_supervisor(T.ToolFake()), trace_dir=tmp_path)
    app.invoke(INPUT, episode_id="e")
    app.flush()
    acts = mine([tmp_path]).actions.sort_values("order").to_dict("records")
    assert [a["agent"] for a in acts] == ["supervisor", "researcher", "researcher", "supervisor", "mathematician",
                                          "mathematician", "supervisor", "researcher", "researcher", "supervisor"]
    assert [a["step"] for a in acts] == [1, 2, 2, 3, 4, 4, 5, 6, 6, 7]
    for first_of_turn, supervisor in ((1, 0), (4, 3), (7, 6)):  # the second hand-off to the researcher too
        assert supervisor in acts[first_of_turn]["depends_on"]
    assert 1 in acts[2]["depends_on"]  # the worker's second call follows its first (the subgraph's previous step)


def test_malformed_and_failing_tool_calls_are_tool_errors(tmp_path):
    app = wrap(T.hand_written_supervisor(T.ToolFake()), trace_dir=tmp_path)
    app.invoke(INPUT, episode_id="e")
    app.flush()
    acts = mine([tmp_path]).actions.sort_values("order").to_dict("records")
    first_research = acts[1]
    assert first_research["tool_errors"] == 1
    bad = [tc for tc in first_research["tool_calls"] if tc["error"]]
    assert bad and bad[0]["id"] == "bad-1" and "unparsable" in bad[0]["error"]
    assert ["facts about otel" in tc["result"] for tc in first_research["tool_calls"] if not tc["error"]] == [True]
    divide = acts[4]
    assert divide["agent"] == "mathematician" and divide["tool_errors"] == 1
    assert "ZeroDivisionError" in divide["tool_calls"][0]["error"]


def test_prebuilt_agents_are_answered_by_their_own_adapter_without_node_roles(tmp_path):
    engine = FakeEngine(agents=("supervisor", "researcher", "mathematician"),
                        script={"supervisor": ["route researcher", "route mathematician", "FINISH"],
                                "researcher": ["found it"], "mathematician": ["computed"]})
    graph = T.hand_written_supervisor(TeamChatModel(unmapped="error"))  # an unmapped node would raise
    app = wrap(graph, team=engine, trace_dir=tmp_path)
    app.invoke({"messages": [("user", "go")]}, episode_id="e")
    assert [r.agent for r in engine.requests] == ["supervisor", "researcher", "supervisor", "mathematician",
                                                  "supervisor"]
    app.flush()
    acts = mine([tmp_path]).actions.sort_values("order")
    assert list(acts["agent"]) == [r.agent for r in engine.requests]
    assert list(acts["adapter_version"]) == ["v1"] * 5


def test_a_custom_subgraph_keeps_its_path_and_node_roles_still_map_it(tmp_path):
    app = wrap(T.nested_custom(T.ToolFake()), trace_dir=tmp_path, node_roles={"team|editor": "editor"})
    app.invoke(INPUT, episode_id="e")
    app.flush()
    assert set(mine([tmp_path]).actions["agent"]) == {"planner", "team|drafter", "editor", "critic"}


def test_a_node_without_role_warns_once_naming_the_fix(tmp_path, caplog):
    engine = FakeEngine(agents=("writer",))
    graph = T.nested_custom(TeamChatModel())
    app = wrap(graph, team=engine, trace_dir=None)
    with caplog.at_level(logging.WARNING, logger="marft_lg.graph"):
        app.invoke(INPUT)
        app.invoke(INPUT)
    warnings = [r.getMessage() for r in caplog.records if "no agent role" in r.getMessage()]
    assert len(warnings) == 4  # planner, team|drafter, team|editor, critic: once each over two runs
    assert any("'team|drafter'" in w and "node_roles" in w for w in warnings)


def test_state_and_graph_methods_are_the_graphs(tmp_path):
    from langgraph.checkpoint.memory import InMemorySaver

    from tests.unit.graph.graph_apps import linear

    graph = linear(TeamChatModel()).builder.compile(checkpointer=InMemorySaver())
    app = wrap(graph, team=FakeEngine(), trace_dir=tmp_path)
    thread = {"configurable": {"thread_id": "t1"}}
    app.invoke({"msgs": ["q"]}, thread, episode_id="one")
    assert len(app.get_state(thread).values["msgs"]) == 4
    app.update_state(thread, {"msgs": ["extra"]})
    assert app.get_state(thread).values["msgs"][-1] == "extra"
    assert len(list(app.get_state_history(thread))) >= 4
    assert set(app.get_graph().nodes) >= {"planner", "writer", "critic"}
    assert app.checkpointer is graph.checkpointer


def test_fifty_concurrent_runs_pinned_to_different_versions_never_cross(tmp_path):
    from tests.unit.graph.graph_apps import linear

    engine = FakeEngine()
    app = wrap(linear(TeamChatModel()), team=engine, trace_dir=tmp_path)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            app.invoke({"msgs": [f"q{i}"]}, episode_id=f"t{i}", versions={"writer": f"v{i}"}, seed=i)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(25)]
    for t in threads:
        t.start()

    async def many():
        await asyncio.gather(*(app.ainvoke({"msgs": [f"q{i}"]}, episode_id=f"a{i}", versions={"writer": f"v{i}"},
                                           seed=i) for i in range(25, 50)))

    asyncio.run(many())
    for t in threads:
        t.join()
    assert not errors
    app.flush()
    acts = mine([tmp_path]).actions
    writer = acts[acts["agent"] == "writer"]
    assert len(writer) == 50
    for eid, version in zip(writer["episode_id"], writer["adapter_version"], strict=True):
        assert version == f"v{eid[1:]}", (eid, version)
    others = acts[acts["agent"] != "writer"]
    assert set(others["adapter_version"]) == {"v1"}


def test_a_malformed_block_left_in_the_content_is_a_tool_error(tmp_path):
    """ChatOpenAI drops the server's `invalid_tool_calls` field: the raw block in the content is still flagged."""
    from langchain_core.messages import AIMessage

    class RawBlock(T.ToolFake):
        def _answer(self, messages):
            if self.tool_names and not any(getattr(m, "type", "") == "tool" for m in messages):
                return AIMessage(content='worker result: <tool_call>{"name": "lookup", "arguments": {"topic": </tool_call>')
            return super()._answer(messages)

    app = wrap(T.hand_written_supervisor(RawBlock()), trace_dir=tmp_path)
    app.invoke(INPUT, episode_id="e")
    app.flush()
    acts = mine([tmp_path]).actions.sort_values("order").to_dict("records")
    worker = acts[1]
    assert worker["agent"] == "researcher" and worker["tool_errors"] == 1
    assert "not valid JSON" in worker["tool_calls"][0]["error"]
