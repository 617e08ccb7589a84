"""The recorder's text fast paths write exactly what the general message path writes, and step aside otherwise."""

from __future__ import annotations

import json
import operator
from typing import Annotated, TypedDict

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from langgraph.graph import END, START, StateGraph

from marft_lg.graph import TeamChatModel
from marft_lg.graph.wrap import WrappedGraph
from marft_lg.serving.types import Completion
from marft_lg.tracing import attributes as A
from marft_lg.tracing.messages import genai_text_messages_json, messages_to_dicts
from marft_lg.tracing.otlp_json import encode_record
from marft_lg.tracing.sink import RecordSink


@pytest.mark.parametrize("messages", [
    [HumanMessage('hi \u00e9 "q"\n\t\u2028')],
    [SystemMessage("sys"), HumanMessage(""), AIMessage("answer")],
    [AIMessage("x", name="bob"), HumanMessage("y", name="ann")],
    [],
])
def test_plain_text_messages_same_bytes_as_general_path(messages):
    assert genai_text_messages_json(messages) == A.to_genai_messages(messages_to_dicts(messages))


@pytest.mark.parametrize("messages", [
    [AIMessage("", tool_calls=[{"name": "t", "args": {"a": 1}, "id": "1"}])],
    [HumanMessage("q"), ToolMessage("r", tool_call_id="1")],
    [ChatMessage(role="critic", content="y")],
    [HumanMessage(content=[{"type": "text", "text": "a"}])],
    [{"role": "user", "content": "a dict"}],
])
def test_anything_else_takes_the_general_path(messages):
    assert genai_text_messages_json(messages) is None


class _Engine:
    model_name = "instant"

    def agents(self):
        return ["planner", "writer", "boss"]

    def versions(self):
        return {"planner": "v1", "writer": "v1", "boss": "v1"}

    def chat(self, requests):
        return [Completion(text=f"{r.agent} ok", prompt_token_ids=[1, 2, 3], completion_token_ids=[4, 5],
                           logprobs=[-0.5, -0.25], agent=r.agent, adapter_version="v1", model="instant")
                for r in requests]


class State(TypedDict):
    msgs: Annotated[list, operator.add]


def _graph(llm):
    g = StateGraph(State)
    g.add_node("planner", lambda s: {"msgs": [llm.invoke(s["msgs"][-1]).content, llm.invoke("again").content]})
    g.add_node("writer", lambda s: {"msgs": [llm.invoke(s["msgs"][-1]).content]})
    g.add_edge(START, "planner")
    g.add_edge("planner", "writer")
    g.add_edge("writer", END)
    return g.compile()


def test_task_attribute_group_encodes_to_the_same_bytes(tmp_path):
    # TeamChatModel maps planner to "boss" itself: the recorder overwrites the task's role on those chat spans.
    sink = RecordSink(None, schedule_delay_s=None)
    app = WrappedGraph(_graph(TeamChatModel(node_roles={"planner": "boss", "writer": "writer"})), team=_Engine(),
                       sink=sink)
    app.invoke({"msgs": ["go"]}, seed=1)
    records = list(sink._queue)
    grouped = [r for r in records if r.group is not None]
    assert {r.name for r in grouped} >= {"invoke_agent planner", "invoke_agent writer", "chat instant"}
    for r in records:
        fast = encode_record(r)
        r.group = None
        assert fast == encode_record(r), r.name
    planner_chats = [r for r in records if r.name.startswith("chat") and r.attributes[A.MARFT_AGENT_NODE] == "planner"]
    assert len(planner_chats) == 2 and all(r.attributes[A.MARFT_AGENT_ROLE] == "boss" for r in planner_chats)
    agent = next(r for r in records if r.name == "invoke_agent planner")
    assert agent.attributes[A.MARFT_AGENT_ROLE] == "planner"
    for r in planner_chats:
        keys = [kv["key"] for kv in json.loads("{" + '"a":[' + encode_record(r).split('"attributes":[', 1)[1]
                                                  .split('],"status"', 1)[0] + "]}")["a"]]
        assert keys.count(A.MARFT_AGENT_ROLE) == 1
    app.close()
