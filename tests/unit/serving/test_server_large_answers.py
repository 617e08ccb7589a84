"""A large answer never freezes the server: it is built and encoded off the event loop, and an answer that could
hold more log-prob entries than the server's limit is refused up front with a 400 naming the parameter."""

from __future__ import annotations

import threading

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from marft_lg.serving.http import chat_api
from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from tests.servers import uvicorn_thread

MSG = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def team(tiny_model_dir):
    torch.set_num_threads(1)
    t = Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4, init=False), versions=None, model_name="tiny")
    yield t
    t.close()


def test_health_answers_while_a_big_answer_is_being_built(team, monkeypatch):
    """The answer's log-prob block is held half-built until /health has answered: on the event loop, /health
    could not answer until the block was done."""
    building, release = threading.Event(), threading.Event()
    original = chat_api._logprobs_block

    def held(*args, **kwargs):
        building.set()
        release.wait(20)
        return original(*args, **kwargs)

    monkeypatch.setattr(chat_api, "_logprobs_block", held)
    outcome: dict[str, object] = {}
    with uvicorn_thread(create_app(team)) as url:
        def big() -> None:
            r = httpx.post(f"{url}/v1/chat/completions", timeout=60, json={
                "model": "planner", "messages": MSG, "n": 4, "logprobs": True, "top_logprobs": 20,
                "max_tokens": 16, "ignore_eos": True, "seed": 1})
            outcome["status"] = r.status_code
            outcome["body"] = r.json()

        sender = threading.Thread(target=big)
        sender.start()
        try:
            assert building.wait(60), "the answer was never built"
            health = httpx.get(f"{url}/health", timeout=5)
            assert health.status_code == 200 and "status" not in outcome  # answered while the answer was held
        finally:
            release.set()
            sender.join(60)
    assert outcome["status"] == 200
    choices = outcome["body"]["choices"]
    assert len(choices) == 4 and all(len(c["logprobs"]["content"]) == 16 for c in choices)
    assert all(len(e["top_logprobs"]) == 20 for c in choices for e in c["logprobs"]["content"])


@pytest.mark.parametrize(("fields", "param"), [
    ({"n": 4, "max_tokens": 100, "top_logprobs": 5}, "top_logprobs"),
    ({"n": 16, "max_tokens": 100}, "n"),
    ({"max_tokens": 2000}, "max_tokens"),
    ({"top_logprobs": 21}, "top_logprobs"),
])
def test_an_answer_over_the_log_prob_limit_is_a_400_naming_the_parameter(team, fields, param):
    with TestClient(create_app(team, max_logprob_entries=1000)) as client:
        r = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "logprobs": True, **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]
        ok = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "logprobs": True,
                                                       "top_logprobs": 3, "n": 2, "max_tokens": 4})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        assert client.post("/v1/chat/completions", json={  # no log-probs asked: no log-prob limit
            "model": "planner", "messages": MSG, "n": 16, "max_tokens": 4}).status_code == 200
