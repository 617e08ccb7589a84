"""Fuzz: whatever bytes a client sends, the server answers JSON: a result, or an error in the OpenAI shape."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team

ERROR_KEYS = {"message", "type", "param", "code"}
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**12), st.floats(allow_nan=True),
                    st.text(max_size=20), st.sampled_from(["planner", "writer", "auto", "none", "required", "user",
                                                           "assistant", "tool", "\ud800"]))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                           max_size=4), max_leaves=12)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                 "content": values}, optional={"tool_calls": values, "tool_call_id": values})
request = st.fixed_dictionaries({}, optional={
    "model": st.sampled_from(["planner", "writer", "planner@v9", "nobody"]) | values,
    "messages": st.lists(message, max_size=3) | values, "prompt": values,
    "max_tokens": st.integers(-3, 3) | values, "temperature": values, "n": st.integers(-1, 3) | values,
    "stream": st.booleans() | values, "tools": values, "tool_choice": values, "stop": values, "seed": values,
    "logprobs": values, "lora_name": values, "lora_path": values})


def _body(data: object) -> bytes:
    return json.dumps(data, ensure_ascii=False).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    torch.set_num_threads(1)
    team = Team(tiny_model_dir, ["planner", "writer"], lora=LoraSettings(r=4, init=False), versions=None,
                model_name="tiny")
    with TestClient(create_app(team, max_body_bytes=256 * 1024), raise_server_exceptions=False) as c:
        yield c
    team.close()


def _check(response) -> None:
    assert response.status_code < 500, response.text[:500]
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return
    body = response.json()  # JSON, whatever happened
    if response.status_code >= 400:
        assert set(body["error"]) == ERROR_KEYS, body


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(route=st.sampled_from(ROUTES), data=request)
def test_random_requests_get_json_answers(client, route, data):
    _check(client.post(route, content=_body(data), headers={"content-type": "application/json"}))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(route=st.sampled_from(ROUTES), raw=st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_random_bytes_get_json_errors(client, route, raw):
    _check(client.post(route, content=raw, headers={"content-type": "application/json"}))
