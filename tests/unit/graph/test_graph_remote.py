"""TeamChatModel against an OpenAI-compatible server (vLLM / `marft-lg serve` wire format), no real server."""

from __future__ import annotations

import asyncio
import json

import httpx
from graph_apps import chats, linear, spans

from marft_lg.graph import TeamChatModel, wrap
from marft_lg.graph.remote import RemoteEngine
from marft_lg.serving.http.client import OpenAIEngineClient
from marft_lg.tracing import attributes as A

SERVED = ["smollm2", "planner", "writer", "planner@v2"]


def _server(seen: list):
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": m, "object": "model"} for m in SERVED]})
        body = json.loads(request.content)
        seen.append(body)
        text = f"{body['model']} says hi"
        ids = [100 + i for i in range(len(text.split()))]
        return httpx.Response(200, json={
            "id": "c1", "model": body["model"], "prompt_token_ids": [1, 2, 3, len(seen)],
            "choices": [{"index": 0, "finish_reason": "length", "token_ids": ids, "message": {"role": "assistant", "content": text},
                         "logprobs": {"content": [{"token": str(t), "logprob": -0.5 - i} for i, t in enumerate(ids)]}}],
            "usage": {"prompt_tokens": 4, "completion_tokens": len(ids)},
        })

    return handler


def test_remote_routing_and_spans(tmp_path):
    seen: list = []
    handler = _server(seen)
    client = OpenAIEngineClient("http://127.0.0.1:9/v1", transport=httpx.MockTransport(handler),
                                async_transport=httpx.MockTransport(handler))
    engine = RemoteEngine(client)
    assert engine.agents() == ["planner", "writer"] and engine.model_name == "smollm2"
    llm = TeamChatModel(team=engine, versions={"planner": "v2"})
    app = wrap(linear(llm, names=("planner", "writer", "other")), trace_dir=tmp_path)
    out = app.invoke({"msgs": ["x"]}, seed=1, episode_id="r")
    assert [b["model"] for b in seen] == ["planner@v2", "writer", "smollm2"]
    assert out["msgs"][1:] == ["planner@v2 says hi", "writer says hi", "smollm2 says hi"]
    assert all(b["logprobs"] is True and b["return_token_ids"] is True and "seed" in b for b in seen)
    calls = chats(spans(app, tmp_path))
    a = calls[0]["attributes"]
    assert A.decode_ints(a[A.MARFT_PROMPT_TOKEN_IDS]) == [1, 2, 3, 1]
    assert A.decode_ints(a[A.MARFT_COMPLETION_TOKEN_IDS]) == [100, 101, 102]
    assert A.decode_floats(a[A.MARFT_COMPLETION_LOGPROBS]) == [-0.5, -1.5, -2.5]
    assert a[A.MARFT_ADAPTER_VERSION] == "v2" and a[A.GEN_AI_RESPONSE_FINISH_REASONS] == ["length"]
    assert calls[2]["attributes"][A.MARFT_ADAPTER_NAME] == ""
    assert asyncio.run(llm.ainvoke("hello")).content == "smollm2 says hi"  # async path, outside any node


def test_base_url_builds_a_remote_engine():
    llm = TeamChatModel(base_url="http://127.0.0.1:9/v1", api_key="k")
    engine = llm._engine(None)
    assert isinstance(engine, RemoteEngine) and engine.client.base_url == "http://127.0.0.1:9"
    assert llm._engine(None) is engine
