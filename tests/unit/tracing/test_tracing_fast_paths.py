"""The recorder's text fast paths write exactly what the general message path writes, and step aside otherwise."""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage

from marft_lg.tracing import attributes as A
from marft_lg.tracing.messages import genai_text_messages_json, messages_to_dicts


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
