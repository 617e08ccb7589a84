"""The real SmolLM2-135M-Instruct served with OpenAI `tools`: a few-shot prompt, greedy, gives `tool_calls`."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.tools import tool

from marft_lg.graph import TeamChatModel
from marft_lg.serving.http.server import create_app
from marft_lg.serving.team import Team

pytestmark = pytest.mark.integration

ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
# One worked example of a call (the server appends the tools, their schemas and example calls).
FEW_SHOT = ("You are a calculator. Always answer with a tool call.\nExample:\nUser: Add 4 and 7\n"
            'Assistant: <tool_call>{"name": "add", "arguments": {"a": 4, "b": 7}}</tool_call>')


@pytest.fixture(scope="module")
def team(embedded_model_dir):
    torch.set_num_threads(1)
    with Team(embedded_model_dir, ["calc"], versions=None, seed=0) as t:
        yield t


@pytest.mark.parametrize(("question", "args"), [("Add 2 and 3", {"a": 2, "b": 3}), ("Add 10 and 25", {"a": 10, "b": 25})])
def test_served_model_returns_tool_calls(team, question, args):
    client = TestClient(create_app(team))
    r = client.post("/v1/chat/completions", json={
        "model": "calc", "messages": [{"role": "system", "content": FEW_SHOT}, {"role": "user", "content": question}],
        "tools": [ADD], "temperature": 0, "max_tokens": 40})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == args


def test_team_chat_model_gets_the_same_call_in_process(team):
    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    llm = TeamChatModel(team=team, temperature=0, max_tokens=40).bind_tools([add])
    msg = llm.invoke([SystemMessage(FEW_SHOT), HumanMessage("Add 2 and 3")])
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("add", {"a": 2, "b": 3})], msg.content
