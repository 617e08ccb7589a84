"""Every topology the issue names, wrapped and traced; spans read back from the JSONL file."""

from __future__ import annotations

import asyncio
import json

import pytest
from graph_apps import agents, by_episode, chats, critic_loop, fan_out, linear, spans, with_subgraph
from graph_fakes import FakeEngine

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.tracing import attributes as A


def test_linear_graph_spans_attribute_by_attribute(tmp_path):
    eng = FakeEngine()
    app = wrap(linear(TeamChatModel()), team=eng, trace_dir=tmp_path)
    out = app.invoke({"msgs": ["hello"]}, episode_id="ep-1", scenario_id="sc-9", seed=11, metadata={"user": "u1"})
    assert out["msgs"][0] == "hello" and len(out["msgs"]) == 4
    got = by_episode(spans(app, tmp_path), "ep-1")
    root = [s for s in got if s["parent_span_id"] is None]
    assert len(root) == 1
    root = root[0]
    assert root["name"] == "invoke_workflow LangGraph"
    assert root["attributes"][A.GEN_AI_OPERATION_NAME] == "invoke_workflow"
    assert root["attributes"][A.MARFT_SCENARIO_ID] == "sc-9"
    assert json.loads(root["attributes"][A.MARFT_EPISODE_METADATA]) == {"user": "u1", "seed": 11}
    assert json.loads(root["attributes"][A.MARFT_OUTCOME]) == out
    assert root["status_code"] == 1
    assert len(root["trace_id"]) == 32 and len(root["span_id"]) == 16
    int(root["trace_id"], 16)

    nodes = agents(got)
    assert [s["name"] for s in nodes] == ["invoke_agent planner", "invoke_agent writer", "invoke_agent critic"]
    assert all(s["parent_span_id"] == root["span_id"] for s in nodes)
    assert [s["attributes"][A.MARFT_LANGGRAPH_STEP] for s in nodes] == [1, 2, 3]
    assert json.loads(nodes[1]["attributes"][A.MARFT_LANGGRAPH_TRIGGERS]) == ["branch:to:writer"]

    calls = chats(got)
    assert len(calls) == 3 == len(eng.requests)
    requests = list(eng.requests)
    for call, node, req in zip(calls, nodes, requests, strict=True):
        a = call["attributes"]
        assert call["kind"] == 3  # CLIENT
        assert call["parent_span_id"] == node["span_id"]
        assert call["name"] == "chat fake-135m"
        assert a[A.GEN_AI_PROVIDER_NAME] == "marft_lg"
        assert a[A.GEN_AI_REQUEST_MODEL] == "fake-135m"
        assert a[A.GEN_AI_AGENT_NAME] == a[A.MARFT_AGENT_ROLE] == req.agent
        assert a[A.GEN_AI_CONVERSATION_ID] == "ep-1"
        assert a[A.MARFT_EPISODE_ID] == "ep-1"
        assert a[A.MARFT_LANGGRAPH_STEP] == node["attributes"][A.MARFT_LANGGRAPH_STEP]
        assert a[A.MARFT_LANGGRAPH_CHECKPOINT_NS] == node["attributes"][A.MARFT_LANGGRAPH_CHECKPOINT_NS]
        assert a[A.GEN_AI_REQUEST_TEMPERATURE] == 1.0 and a[A.GEN_AI_REQUEST_MAX_TOKENS] == 256
        assert a[A.GEN_AI_REQUEST_SEED] == req.seed
        assert a[A.MARFT_ADAPTER_VERSION] == "v1" and a[A.MARFT_ADAPTER_NAME] == req.agent
        completion = eng.chat([req])[0]
        assert A.decode_ints(a[A.MARFT_PROMPT_TOKEN_IDS]) == completion.prompt_token_ids
        assert A.decode_ints(a[A.MARFT_COMPLETION_TOKEN_IDS]) == completion.completion_token_ids
        assert A.decode_floats(a[A.MARFT_COMPLETION_LOGPROBS]) == pytest.approx(completion.logprobs, abs=1e-6)
        assert a[A.GEN_AI_USAGE_INPUT_TOKENS] == len(completion.prompt_token_ids)
        assert a[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(completion.completion_token_ids)
        assert A.from_genai_messages(a[A.GEN_AI_INPUT_MESSAGES]) == req.messages
        assert A.from_genai_messages(a[A.GEN_AI_OUTPUT_MESSAGES])[0]["content"] == completion.text
        assert a[A.MARFT_LATENCY_S] > 0


def test_wrapped_output_equals_unwrapped_for_same_seed(tmp_path):
    eng = FakeEngine()
    llm = TeamChatModel(team=eng, seed=5)
    graph = critic_loop(llm)
    plain = graph.invoke({"msgs": ["x"]})
    app = wrap(graph, trace_dir=tmp_path)
    assert app.invoke({"msgs": ["x"]}, seed=5) == plain
    assert app.invoke({"msgs": ["x"]}) == plain  # the model's own seed when the invocation gives none
    assert app.invoke({"msgs": ["x"]}, seed=6) != plain  # the seed matters, so the equality above means something


def test_conditional_loop_records_every_turn(tmp_path):
    eng = FakeEngine()
    app = wrap(critic_loop(TeamChatModel()), team=eng, trace_dir=tmp_path)
    app.invoke({"msgs": ["topic"]}, episode_id="loop")
    got = by_episode(spans(app, tmp_path), "loop")
    assert [s["attributes"][A.MARFT_AGENT_NODE] for s in agents(got)] == ["writer", "critic"] * 3
    steps = [s["attributes"][A.MARFT_LANGGRAPH_STEP] for s in chats(got)]
    assert steps == sorted(steps) and len(set(steps)) == 6
    assert json.loads(agents(got)[2]["attributes"][A.MARFT_LANGGRAPH_TRIGGERS]) == ["branch:to:writer"]


def test_send_fan_out_tasks_are_distinct_actions(tmp_path):
    eng = FakeEngine()
    app = wrap(fan_out(TeamChatModel()), team=eng, trace_dir=tmp_path)
    app.invoke({"msgs": ["go"]}, episode_id="fan", seed=1)
    got = by_episode(spans(app, tmp_path), "fan")
    writers = [s for s in agents(got) if s["attributes"][A.MARFT_AGENT_NODE] == "writer"]
    assert len(writers) == 3
    assert len({s["attributes"][A.MARFT_LANGGRAPH_TASK_ID] for s in writers}) == 3
    assert len({s["attributes"][A.MARFT_LANGGRAPH_STEP] for s in writers}) == 1
    writer_calls = [c for c in chats(got) if c["attributes"][A.MARFT_AGENT_NODE] == "writer"]
    assert len(writer_calls) == 3
    assert {c["parent_span_id"] for c in writer_calls} == {s["span_id"] for s in writers}
    assert len({c["attributes"][A.GEN_AI_REQUEST_SEED] for c in writer_calls}) == 3
    # Parallel tasks get seeds from their Send index, not from thread timing: a rerun is identical.
    again = wrap(fan_out(TeamChatModel()), team=FakeEngine(), trace_dir=tmp_path / "again")
    assert again.invoke({"msgs": ["go"]}, seed=1) == app.invoke({"msgs": ["go"]}, seed=1)


def test_subgraph_nodes_are_namespaced_and_mapped(tmp_path):
    eng = FakeEngine()
    app = wrap(with_subgraph(TeamChatModel()), team=eng, trace_dir=tmp_path, node_roles={"researcher": "critic"})
    app.invoke({"msgs": ["q"]}, episode_id="sub")
    got = by_episode(spans(app, tmp_path), "sub")
    names = [s["attributes"][A.MARFT_AGENT_NODE] for s in agents(got)]
    assert names == ["planner", "research", "research|researcher", "writer"]
    research = agents(got)[1]
    inner = agents(got)[2]
    assert inner["parent_span_id"] == research["span_id"]
    inner_call = [c for c in chats(got) if c["attributes"][A.MARFT_AGENT_NODE] == "research|researcher"][0]
    assert inner_call["attributes"][A.MARFT_AGENT_ROLE] == "critic"
    assert inner_call["attributes"][A.MARFT_ADAPTER_NAME] == "critic"
    assert [r.agent for r in eng.requests] == ["planner", "critic", "writer"]


def test_async_invoke_and_astream(tmp_path):
    eng = FakeEngine()
    graph = linear(TeamChatModel())
    app = wrap(graph, team=eng, trace_dir=tmp_path)

    async def run():
        out = await app.ainvoke({"msgs": ["a"]}, episode_id="async-1", seed=2)
        chunks = [c async for c in app.astream({"msgs": ["a"]}, episode_id="async-2", seed=2, stream_mode="updates")]
        return out, chunks

    out, chunks = asyncio.run(run())
    assert [list(c)[0] for c in chunks] == ["planner", "writer", "critic"]
    assert chunks[-1]["critic"]["msgs"][0] == out["msgs"][-1]
    got = spans(app, tmp_path)
    for eid in ("async-1", "async-2"):
        assert [c["attributes"][A.MARFT_AGENT_NODE] for c in chats(by_episode(got, eid))] == ["planner", "writer", "critic"]


def test_stream_values_and_messages(tmp_path):
    eng = FakeEngine()
    graph = linear(TeamChatModel(), names=("planner", "writer"))
    app = wrap(graph, team=eng, trace_dir=tmp_path)
    values = list(app.stream({"msgs": ["s"]}, episode_id="st-1", seed=4, stream_mode="values"))
    assert values[-1] == app.invoke({"msgs": ["s"]}, seed=4)
    msgs = list(app.stream({"msgs": ["s"]}, episode_id="st-2", seed=4, stream_mode="messages"))
    texts = [m.content for m, meta in msgs if m.content]  # LangChain appends an empty closing chunk per call
    assert texts == values[-1]["msgs"][1:]
    got = spans(app, tmp_path)
    root = [s for s in by_episode(got, "st-1") if s["parent_span_id"] is None][0]
    assert json.loads(root["attributes"][A.MARFT_OUTCOME]) == values[-1]
    assert len(chats(by_episode(got, "st-2"))) == 2


def test_sqlite_checkpointer_threads(tmp_path):
    from langgraph.checkpoint.sqlite import SqliteSaver

    eng = FakeEngine()
    with SqliteSaver.from_conn_string(str(tmp_path / "ck.sqlite")) as saver:
        graph = linear(TeamChatModel(), names=("planner", "writer")).builder.compile(checkpointer=saver)
        app = wrap(graph, team=eng, trace_dir=tmp_path / "tr")
        cfg = {"configurable": {"thread_id": "t-1"}}
        first = app.invoke({"msgs": ["one"]}, cfg, episode_id="turn-1")
        second = app.invoke({"msgs": ["two"]}, cfg, episode_id="turn-2")
        assert second["msgs"][:3] == first["msgs"]  # state carried over by the checkpointer
        assert app.get_state(cfg).values == second  # passthrough of graph attributes
    got = spans(app, tmp_path / "tr")
    for eid in ("turn-1", "turn-2"):
        calls = chats(by_episode(got, eid))
        assert len(calls) == 2
        assert {c["attributes"][A.GEN_AI_CONVERSATION_ID] for c in calls} == {"t-1"}


def test_batch_gives_each_input_its_episode(tmp_path):
    eng = FakeEngine()
    app = wrap(linear(TeamChatModel(), names=("planner",)), team=eng, trace_dir=tmp_path)
    outs = app.batch([{"msgs": ["a"]}, {"msgs": ["b"]}], episode_ids=["b-0", "b-1"], scenario_ids=["s0", "s1"], seeds=[1, 1])
    assert [o["msgs"][0] for o in outs] == ["a", "b"]
    got = spans(app, tmp_path)
    for i in range(2):
        root = [s for s in by_episode(got, f"b-{i}") if s["parent_span_id"] is None][0]
        assert root["attributes"][A.MARFT_SCENARIO_ID] == f"s{i}"


def test_abatch_and_a_stream_closed_early(tmp_path):
    eng = FakeEngine()
    app = wrap(linear(TeamChatModel()), team=eng, trace_dir=tmp_path)
    outs = asyncio.run(app.abatch([{"msgs": ["a"]}, {"msgs": ["b"]}], episode_ids=["ab-0", "ab-1"], seeds=[3, 3]))
    assert [o["msgs"][0] for o in outs] == ["a", "b"]
    stream = app.stream({"msgs": ["c"]}, episode_id="early", stream_mode="updates")
    first = next(stream)
    assert list(first) == ["planner"]
    stream.close()  # the caller stops listening after the first node
    got = spans(app, tmp_path)
    for eid in ("ab-0", "ab-1"):
        assert len(chats(by_episode(got, eid))) == 3
    early = by_episode(got, "early")
    roots = [s for s in early if s["parent_span_id"] is None]
    assert len(roots) == 1 and roots[0]["status_code"] == 1 and A.MARFT_OUTCOME not in roots[0]["attributes"]
    assert [c["attributes"][A.MARFT_AGENT_NODE] for c in chats(early)] == ["planner"]
