"""A plain ChatOpenAI that asks for vLLM's `return_tokens_as_token_ids` leaves the completion's token ids in the trace."""

from __future__ import annotations

import json

import httpx
from graph_apps import chats, linear, spans

from marft_lg.graph import wrap
from marft_lg.tracing import attributes as A


def _transport(seen: list):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        as_ids = bool(body.get("return_tokens_as_token_ids"))
        ids = [11, 7, 2]
        tokens = [f"token_id:{i}" if as_ids else t for i, t in zip(ids, ["a", " b", "!"], strict=True)]
        return httpx.Response(200, json={
            "id": f"cmpl-{len(seen)}", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "a b!"},
                         "logprobs": {"content": [{"token": t, "logprob": -0.5, "bytes": list(t.encode()),
                                                   "top_logprobs": []} for t in tokens]}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
        })

    return httpx.MockTransport(handler)


def _llm(seen: list, **kwargs):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model="writer", base_url="http://127.0.0.1:1/v1", api_key="x", logprobs=True,
                      http_client=httpx.Client(transport=_transport(seen)), **kwargs)


def test_token_id_tokens_become_completion_token_ids(tmp_path):
    seen: list = []
    app = wrap(linear(_llm(seen, extra_body={"return_tokens_as_token_ids": True}), names=("planner", "writer")),
               trace_dir=tmp_path)
    app.invoke({"msgs": ["hi"]}, episode_id="ids")
    assert all(body["return_tokens_as_token_ids"] is True for body in seen)
    for call in chats(spans(app, tmp_path)):
        a = call["attributes"]
        assert A.decode_ints(a[A.MARFT_COMPLETION_TOKEN_IDS]) == [11, 7, 2]
        assert A.decode_floats(a[A.MARFT_COMPLETION_LOGPROBS]) == [-0.5, -0.5, -0.5]


def test_text_tokens_give_no_token_ids(tmp_path):
    seen: list = []
    app = wrap(linear(_llm(seen), names=("planner", "writer")), trace_dir=tmp_path)
    app.invoke({"msgs": ["hi"]}, episode_id="text")
    for call in chats(spans(app, tmp_path)):
        assert A.MARFT_COMPLETION_TOKEN_IDS not in call["attributes"]
        assert A.MARFT_COMPLETION_LOGPROBS in call["attributes"]
