"""Forced tool calls and structured output hold on the real 135M model, through every client, streaming included.

Before constrained decoding, `tool_choice: "required"` and a named tool came back as plain text 3 of 3 times on
this model (greedy, "what is the capital of Kenya?"); now each of 10 prompts gets a valid call, and
`with_structured_output` returns a valid pydantic object 10 of 10 times through ChatOpenAI and TeamChatModel.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from marft_lg.graph import TeamChatModel
from marft_lg.serving.http.server import create_app
from marft_lg.serving.team import Team

pytestmark = [pytest.mark.integration]

CAPITAL = {"type": "function", "function": {
    "name": "get_capital", "description": "The capital city of a country.",
    "parameters": {"type": "object", "properties": {"country": {"type": "string"}}, "required": ["country"]}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
QUESTIONS = ["What is the capital of Kenya?", "Hi there!", "Tell me a joke.", "What's 2+2?", "Capital of France?",
             "Is it raining in Oslo?", "Who wrote Hamlet?", "Name a river in Peru.", "Good morning.",
             "Which country is Lima in?"]


class Place(BaseModel):
    city: str = Field(max_length=40)
    country: str = Field(max_length=40)
    is_capital: bool


@pytest.fixture(scope="module")
def team(embedded_model_dir):
    with Team(embedded_model_dir, ["planner", "writer"], versions=None) as t:
        yield t


@pytest.fixture(scope="module")
def client(team):
    with TestClient(create_app(team)) as c:
        yield c


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_capital"}}])
def test_forced_tool_calls_hold_on_ten_prompts(client, choice):
    import concurrent.futures

    def ask(q: str) -> dict:
        r = client.post("/v1/chat/completions", json={
            "model": "planner", "messages": [{"role": "user", "content": q}], "tools": [CAPITAL, WEATHER],
            "tool_choice": choice, "temperature": 0, "max_tokens": 64})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    with concurrent.futures.ThreadPoolExecutor(10) as pool:  # one batch, as an app's concurrent agents send them
        answers = list(pool.map(ask, QUESTIONS))
    allowed = {"get_capital", "get_weather"} if choice == "required" else {"get_capital"}
    for q, a in zip(QUESTIONS, answers, strict=True):
        calls = a["message"].get("tool_calls") or []
        assert len(calls) >= 1 and {c["function"]["name"] for c in calls} <= allowed, (q, a["message"])
        assert a["finish_reason"] == "tool_calls" and not a["message"].get("invalid_tool_calls"), (q, a)


def _ten_of_ten(llm) -> None:
    """`with_structured_output(Place)` gives a valid Place for each of the 10 prompts: both methods, and streamed."""
    prompts = [f"{q} Describe the place it is about." for q in QUESTIONS]
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Place, method=method).batch(prompts)
        assert all(isinstance(o, Place) for o in out), (method, out)
    streamed = [list(llm.with_structured_output(Place).stream(p)) for p in prompts]
    assert all(chunks and isinstance(chunks[-1], Place) for chunks in streamed), streamed


def test_chat_openai_with_structured_output_ten_of_ten_streaming_included(http_url):
    from langchain_openai import ChatOpenAI

    _ten_of_ten(ChatOpenAI(base_url=http_url, api_key="none", model="writer", temperature=0, max_tokens=96,
                           max_retries=0))


def test_team_chat_model_with_structured_output_ten_of_ten_streaming_included(team):
    llm = TeamChatModel(team=team, agent="writer", temperature=0, max_tokens=96)
    _ten_of_ten(llm)
    forced = llm.bind_tools([CAPITAL], tool_choice="get_capital").batch(QUESTIONS)
    assert all([c["name"] for c in m.tool_calls] == ["get_capital"] for m in forced)


def test_auto_stays_free(client):
    r = client.post("/v1/chat/completions", json={
        "model": "planner", "messages": [{"role": "user", "content": "Hi there!"}], "tools": [CAPITAL],
        "tool_choice": "auto", "temperature": 0, "max_tokens": 32})
    assert r.status_code == 200 and r.json()["marft"]["logprobs_masked"] is False  # decoded without a grammar
