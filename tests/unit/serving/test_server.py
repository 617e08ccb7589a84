"""The OpenAI-compatible server (in-process through FastAPI's TestClient): fields, errors, adapter loading."""

from __future__ import annotations

import json

import pytest
import torch
from fastapi.testclient import TestClient

from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.registry.store import AdapterRegistry
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest

MSG = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    torch.set_num_threads(1)
    reg = AdapterRegistry(tmp_path_factory.mktemp("reg"))
    team = Team(tiny_model_dir, ["planner", "writer"], lora=LoraSettings(r=4, init=False), registry=reg,
                versions=None, model_name="tiny")
    team.save_version("planner")  # v1
    with team.exclusive() as model:
        for name, p in model.named_parameters():
            if "lora_B" in name and "planner@init" in name:
                p.data.mul_(3.0)
    team.save_version("planner")  # v2
    with TestClient(create_app(team, api_key="sekret")) as client:
        client.headers["Authorization"] = "Bearer sekret"
        yield client, team, reg
    team.close()


def _chat(client, **body):
    return client.post("/v1/chat/completions", json={"messages": MSG, "max_tokens": 4, **body})


def test_models_and_health(served):
    client, team, _ = served
    assert client.get("/health").json() == {"status": "ok"}
    ids = [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert ids[:3] == ["tiny", "planner", "writer"]
    assert {"planner@init", "writer@init"} <= set(ids)


def test_chat_returns_vllm_fields(served):
    client, team, _ = served
    r = _chat(client, model="planner", logprobs=True, top_logprobs=2, return_token_ids=True, seed=3, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["model"] == "planner"
    assert len(choice["token_ids"]) == 4 == body["usage"]["completion_tokens"]
    assert body["prompt_token_ids"] == team.engine.encode(ChatRequest(MSG))
    content = choice["logprobs"]["content"]
    assert [len(c["top_logprobs"]) for c in content] == [2, 2, 2, 2]
    assert all(c["logprob"] <= c["top_logprobs"][0]["logprob"] + 1e-6 for c in content)
    assert choice["finish_reason"] == "length" and body["marft"]["adapter_version"] == "init"
    # Same seed through the Python API: same tokens and log-probs.
    c = team.chat([ChatRequest(MSG, agent="planner", max_tokens=4, seed=3, ignore_eos=True)])[0]
    assert c.completion_token_ids == choice["token_ids"]
    assert [x["logprob"] for x in content] == pytest.approx(c.logprobs, abs=1e-6)


def test_pinned_version_n_and_stream(served):
    client, _, _ = served
    r = _chat(client, model="planner@v1", n=2, seed=1, return_token_ids=True)
    assert r.status_code == 200, r.text
    assert r.json()["marft"]["adapter_version"] == "v1" and len(r.json()["choices"]) == 2
    with client.stream("POST", "/v1/chat/completions",
                       json={"model": "writer", "messages": MSG, "max_tokens": 3, "stream": True, "seed": 2}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    streamed = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "")
                       for ln in lines[:-1] if json.loads(ln[6:])["choices"])
    plain = _chat(client, model="writer", max_tokens=3, seed=2).json()["choices"][0]["message"]["content"]
    assert streamed == plain


def test_errors_are_400_404_401(served):
    client, _, _ = served
    r = _chat(client, model="critic")
    assert r.status_code == 404 and "planner" in r.json()["error"]["message"]
    assert _chat(client, model="planner@v42").status_code == 404
    assert client.post("/v1/chat/completions", content=b"{not json").status_code == 400
    for bad in ({"model": "planner", "messages": "hi"}, {"model": "planner", "messages": MSG, "max_tokens": "9"},
                {"model": "planner", "messages": MSG, "top_p": 0}, {"messages": MSG},
                {"model": "planner", "messages": [{"content": "no role"}]}):
        r = client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["message"]
    r = _chat(client, model="planner", messages=[{"role": "user", "content": "word " * 2100}])
    assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
    assert client.get("/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    anon = TestClient(client.app)
    assert anon.get("/v1/models").status_code == 401
    assert anon.get("/health").status_code == 200


def test_load_and_unload_lora_adapter(served, tmp_path):
    client, team, reg = served
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "planner", "lora_path": str(reg.path("planner", "v2"))})
    assert r.status_code == 200, r.text
    assert team.versions()["planner"] == "v2"
    assert _chat(client, model="planner").json()["marft"]["adapter_version"] == "v2"
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "planner@v1", "lora_path": str(reg.path("planner", "v1"))})
    assert r.status_code == 200 and "planner@v1" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "planner@v1"}).status_code == 200
    assert "planner@v1" not in team.engine.loaded_adapters()
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "planner"}).status_code == 400
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "planner@v2"}).status_code == 400
    # Paths outside the registry root, traversal and wrong roles are refused.
    outside = tmp_path / "evil"
    outside.mkdir()
    for path in (str(outside), str(reg.root / "planner" / ".." / ".." / "x"), "/etc", str(reg.root / "planner")):
        r = client.post("/v1/load_lora_adapter", json={"lora_name": "planner", "lora_path": path})
        assert r.status_code == 400, (path, r.text)
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "writer", "lora_path": str(reg.path("planner", "v1"))})
    assert r.status_code == 400 and "not of 'writer'" in r.json()["error"]["message"]
    r = client.post("/v1/load_lora_adapter", json={"lora_name": "ghost", "lora_path": str(reg.path("planner", "v1"))})
    assert r.status_code == 404
    assert team.versions()["planner"] == "v2"


def test_tokens_as_token_ids(served):
    """vLLM's `return_tokens_as_token_ids`: each log-prob token (and top token) is ``token_id:{id}``."""
    client, team, _ = served
    r = _chat(client, model="planner", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True,
              return_token_ids=True, seed=3, ignore_eos=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    assert all(c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    plain = _chat(client, model="planner", logprobs=True, seed=3, ignore_eos=True).json()["choices"][0]
    assert not any(c["token"].startswith("token_id:") for c in plain["logprobs"]["content"])
