"""TeamChatModel: routing per node, version pins, seeds, tool calls, structured output, streaming, batch."""

from __future__ import annotations

import asyncio
import json

import pytest
from graph_apps import chats, linear, spans
from graph_fakes import FakeEngine
from langchain_core.exceptions import OutputParserException
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from pydantic import BaseModel

from marft_lg.graph import TeamChatModel, UnmappedNodeError, wrap
from marft_lg.tool_calls import parse_tool_calls
from marft_lg.tracing import attributes as A


def test_node_roles_and_unmapped_policy(tmp_path):
    eng = FakeEngine(agents=("planner", "writer"))
    graph = linear(TeamChatModel(), names=("plan", "writer", "extra"))
    app = wrap(graph, team=eng, trace_dir=tmp_path, node_roles={"plan": "planner"})
    app.invoke({"msgs": ["x"]})
    # mapped node -> its role; node named like an agent -> that agent; unknown node -> base model
    assert [r.agent for r in eng.requests] == ["planner", "writer", None]
    calls = chats(spans(app, tmp_path))
    assert calls[2]["attributes"][A.MARFT_ADAPTER_NAME] == ""
    assert calls[2]["attributes"][A.MARFT_AGENT_ROLE] == "extra"

    strict = wrap(linear(TeamChatModel(unmapped="error"), names=("plan", "extra")), team=eng, trace_dir=tmp_path,
                  node_roles={"plan": "planner"})
    with pytest.raises(UnmappedNodeError, match="node 'extra' has no agent role"):
        strict.invoke({"msgs": ["x"]})


def test_node_roles_to_unknown_role_is_an_actionable_error():
    eng = FakeEngine(agents=("planner",))
    llm = TeamChatModel(team=eng, node_roles={"plan": "ghost"})
    with pytest.raises(UnmappedNodeError, match="maps node 'plan' to role 'ghost'"):
        linear(llm, names=("plan",)).invoke({"msgs": ["x"]})


def test_versions_pin_per_invocation_and_default(tmp_path):
    eng = FakeEngine()
    app = wrap(linear(TeamChatModel(versions={"critic": "v2"})), team=eng, trace_dir=tmp_path)
    app.invoke({"msgs": ["x"]}, versions={"writer": "v7"})
    assert [(r.agent, r.version) for r in eng.requests] == [("planner", None), ("writer", "v7"), ("critic", "v2")]
    eng.requests.clear()
    app.invoke({"msgs": ["x"]}, versions="candidate")
    assert [r.version for r in eng.requests] == ["candidate"] * 3
    versions = [c["attributes"][A.MARFT_ADAPTER_VERSION] for c in chats(spans(app, tmp_path))]
    assert versions == ["v1", "v7", "v2", "candidate", "candidate", "candidate"]


def test_seeds_are_deterministic_and_distinct_per_call():
    eng = FakeEngine()
    llm = TeamChatModel(team=eng, seed=3)
    graph = linear(llm)
    graph.invoke({"msgs": ["x"]})
    first = [r.seed for r in eng.requests]
    eng.requests.clear()
    graph.invoke({"msgs": ["x"]})
    assert [r.seed for r in eng.requests] == first
    assert len(set(first)) == 3
    assert llm.invoke("hi", seed=99) and eng.requests[-1].seed == 99  # an explicit seed wins


def test_unwrapped_call_index_counts_per_task_and_forgets_old_tasks():
    from marft_lg.graph.chat_model import _CallCounter

    llm = TeamChatModel(team=FakeEngine(), seed=3)
    assert [llm._next_call_index("writer:a") for _ in range(3)] == [0, 1, 2]
    assert llm._next_call_index("writer:b") == 0
    counter = _CallCounter(limit=2)
    assert [counter.next(k) for k in ("a", "a", "b", "c", "a")] == [0, 1, 0, 0, 0]  # "a" was evicted by "c"


def test_tool_calls_parsed_and_malformed_reported():
    text = ('thinking <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"a": </tool_call>'
            '<tool_call>{"name": "rm", "arguments": {}}</tool_call><tool_call>{"name": "add"')
    valid, invalid = parse_tool_calls(text, ["add"])
    assert [(c["name"], c["args"]) for c in valid] == [("add", {"a": 1, "b": 2})]
    assert "not valid JSON" in invalid[0]["error"] and "<tool_call>" in invalid[0]["error"]
    assert "unknown tool 'rm'" in invalid[1]["error"]
    assert "not closed" in invalid[2]["error"]
    assert parse_tool_calls(text, ["add"]) == (valid, invalid)  # ids are stable


def test_bind_tools_prompt_history_and_invalid_calls():
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    eng = FakeEngine(agents=("planner",), script={None: ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
                                                        "<tool_call>{oops}</tool_call>"]})
    llm = TeamChatModel(team=eng).bind_tools([add], tool_choice="any")
    msg = llm.invoke([HumanMessage("2+3?")])
    assert msg.tool_calls == [{"name": "add", "args": {"a": 2, "b": 3}, "id": msg.tool_calls[0]["id"], "type": "tool_call"}]
    system = eng.requests[0].messages[0]
    assert system["role"] == "system" and '"name": "add"' in system["content"] and "must call" in system["content"]
    bad = llm.invoke([HumanMessage("2+3?"), msg, ToolMessage("5", tool_call_id=msg.tool_calls[0]["id"])])
    assert bad.tool_calls == [] and "not valid JSON" in bad.invalid_tool_calls[0]["error"]
    history = eng.requests[1].messages
    assert history[2] == {"role": "assistant", "content": msg.content}
    assert history[3] == {"role": "tool", "content": "5", "tool_call_id": msg.tool_calls[0]["id"]}
    # an AIMessage built by code (no text) is shown to the model in the same block format
    rendered = TeamChatModel._chat_messages([AIMessage("", tool_calls=[{"name": "add", "args": {"a": 1}, "id": "c"}])], {})
    assert rendered[0]["content"] == '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'


def test_structured_output_json_schema_and_function_calling():
    class Plan(BaseModel):
        steps: list[str]
        done: bool

    eng = FakeEngine(script={None: ['Sure: {"steps": ["a", "b"], "done": false} hope that helps', "no json here"]})
    structured = TeamChatModel(team=eng).with_structured_output(Plan)
    assert structured.invoke("plan") == Plan(steps=["a", "b"], done=False)
    assert "JSON schema" in eng.requests[0].messages[0]["content"]
    with pytest.raises(OutputParserException, match="no JSON object"):
        structured.invoke("plan")
    raw = TeamChatModel(team=eng).with_structured_output(Plan, include_raw=True).invoke("plan")
    assert raw["parsed"] == Plan(steps=["a", "b"], done=False) and raw["parsing_error"] is None

    eng2 = FakeEngine(script={None: ['<tool_call>{"name": "Plan", "arguments": {"steps": ["x"], "done": true}}</tool_call>']})
    fc = TeamChatModel(team=eng2).with_structured_output(Plan, method="function_calling")
    assert fc.invoke("plan") == Plan(steps=["x"], done=True)


def test_stream_batch_and_async_keep_metadata():
    eng = FakeEngine()
    llm = TeamChatModel(team=eng, seed=1)
    chunks = list(llm.stream("hi"))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    assert full.content == llm.invoke("hi").content
    assert full.response_metadata["marft"]["completion_token_ids"] == [ord(c) for c in full.content]
    outs = llm.batch(["a", "b", "c"])
    assert [o.content for o in outs] == [llm.invoke(x).content for x in ["a", "b", "c"]]
    assert asyncio.run(llm.ainvoke("hi")).content == full.content


def test_create_agent_with_tools_is_traced(tmp_path):
    from langchain.agents import create_agent

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @tool
    def explode(x: int) -> int:
        """Always fails."""
        raise ValueError("kaboom")

    eng = FakeEngine(agents=("solver",), script={"solver": [
        '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>',
        '<tool_call>{"name": "explode", "arguments": {"x": 1}}</tool_call>',
        "The answer is 5.",
    ]})
    agent = create_agent(model=TeamChatModel(), tools=[add, explode], system_prompt="You solve sums.")
    app = wrap(agent, team=eng, trace_dir=tmp_path, node_roles={"model": "solver"})
    # ToolNode re-raises a tool's own exception (only bad arguments become a ToolMessage): the run
    # fails, but every span up to the failure is there, the failing tool with error status.
    with pytest.raises(ValueError, match="kaboom"):
        app.invoke({"messages": [HumanMessage("2+3?")]}, episode_id="agent-1")
    got = spans(app, tmp_path)
    tools = [s for s in got if s["attributes"].get(A.GEN_AI_OPERATION_NAME) == "execute_tool"]
    assert [t["name"] for t in tools] == ["execute_tool add", "execute_tool explode"]
    assert tools[0]["status_code"] == 1 and tools[0]["attributes"][A.GEN_AI_TOOL_CALL_RESULT] == '"5"'
    assert json.loads(tools[0]["attributes"][A.GEN_AI_TOOL_CALL_ARGUMENTS]) == {"a": 2, "b": 3}
    assert tools[1]["status_code"] == 2 and "kaboom" in tools[1]["status_message"]
    assert tools[1]["attributes"][A.ERROR_TYPE] == "ValueError"
    assert tools[0]["attributes"][A.GEN_AI_TOOL_CALL_ID]
    root = [s for s in got if s["parent_span_id"] is None][0]
    assert root["status_code"] == 2
    calls = chats(got)
    assert len(calls) == 2 and calls[0]["attributes"][A.MARFT_AGENT_ROLE] == "solver"
    assert json.loads(calls[0]["attributes"][A.MARFT_TOOL_CALLS])[0]["args"] == {"a": 2, "b": 3}
    assert A.from_genai_messages(calls[0]["attributes"][A.GEN_AI_INPUT_MESSAGES])[0]["content"].startswith("You solve sums.")

    # without the failing tool the agent loop runs to its answer
    eng.script["solver"] = [eng.script["solver"][0], "The answer is 5."]
    eng._calls.clear()
    out = app.invoke({"messages": [HumanMessage("2+3?")]}, episode_id="agent-2")
    assert out["messages"][-1].content == "The answer is 5." and out["messages"][2].content == "5"
