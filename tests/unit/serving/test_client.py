"""OpenAIEngineClient against a fake server that answers with vLLM 0.32-shaped JSON (httpx.MockTransport)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from marft_lg.serving.errors import ContextLengthError, UnknownAgentError
from marft_lg.serving.http.client import (
    MalformedResponseError,
    OpenAIEngineClient,
    ServerRequestError,
    ServerUnavailableError,
)
from marft_lg.serving.types import ChatRequest

BASE = "base-model"


def vllm_chat_response(model: str, prompt_ids, token_ids, logprobs, text="hi there", finish="stop"):
    """The body vLLM 0.32 returns for `logprobs: true, return_token_ids: true` (trimmed of null extras)."""
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None, "reasoning": None},
            "logprobs": {"content": [{"token": f"t{t}", "logprob": lp, "bytes": [], "top_logprobs": []}
                                     for t, lp in zip(token_ids, logprobs, strict=True)]},
            "finish_reason": finish, "stop_reason": None, "token_ids": token_ids, "routed_experts": None,
        }],
        "usage": {"prompt_tokens": len(prompt_ids), "total_tokens": len(prompt_ids) + len(token_ids),
                  "completion_tokens": len(token_ids)},
        "prompt_logprobs": None, "prompt_token_ids": prompt_ids,
    }


def error_body(message: str, code: int, type_: str = "BadRequestError"):
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


class FakeVLLM:
    """Just enough of vLLM's OpenAI server: models, chat completions, LoRA load/unload, health."""

    def __init__(self, delay_s: float = 0.0):
        self.adapters: dict[str, str] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.delay_s = delay_s

    def _models(self):
        cards = [{"id": BASE, "object": "model", "max_model_len": 2048, "root": "/m", "parent": None}]
        cards += [{"id": n, "object": "model", "root": p, "parent": BASE} for n, p in self.adapters.items()]
        return {"object": "list", "data": cards}

    def chat(self, body: dict) -> httpx.Response:
        model = body["model"]
        if model != BASE and model not in self.adapters:
            return httpx.Response(404, json=error_body(f"The model `{model}` does not exist.", 404, "NotFoundError"))
        text = body["messages"][-1]["content"]
        if len(text) > 100:
            return httpx.Response(400, json=error_body(
                "This model's maximum context length is 2048 tokens. However, your prompt contains at least 2049 "
                "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
                "of the input prompt. (parameter=input_tokens, value=2049)", 400))
        n = body["max_tokens"]
        token_ids = [100 + i for i in range(n)]
        return httpx.Response(200, json=vllm_chat_response(
            model, [1, 2, 3, len(text)], token_ids, [-0.5 * (i + 1) for i in range(n)], text=f"{model}:{text}",
            finish="length"))

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else {}
        self.requests.append((request.method, request.url.path, body))
        path = request.url.path
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json=self._models())
        if path == "/v1/chat/completions":
            return self.chat(body)
        if path == "/v1/load_lora_adapter":
            name = body["lora_name"]
            if name in self.adapters and not body.get("load_inplace"):
                return httpx.Response(400, json=error_body(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in "
                    f"place, set 'load_inplace' to True.", 400, "InvalidUserInput"))
            self.adapters[name] = body["lora_path"]
            return httpx.Response(200, text=f"Success: LoRA adapter '{name}' added successfully.")
        if path == "/v1/unload_lora_adapter":
            name = body["lora_name"]
            if name not in self.adapters:
                return httpx.Response(404, json=error_body(
                    f"The lora adapter '{name}' cannot be found.", 404, "NotFoundError"))
            del self.adapters[name]
            return httpx.Response(200, text="Success")
        return httpx.Response(404, json={"detail": "Not Found"})

    async def ahandle(self, request: httpx.Request) -> httpx.Response:
        await request.aread()
        body = json.loads(request.content) if request.content else {}
        # Later requests finish first, so the client must put results back in request order.
        await asyncio.sleep(self.delay_s / (1 + body.get("seed", 0)))
        return self.handle(request)


@pytest.fixture
def fake() -> FakeVLLM:
    return FakeVLLM()


@pytest.fixture
def client(fake) -> OpenAIEngineClient:
    c = OpenAIEngineClient("http://127.0.0.1:9/v1", api_key="sk-test", transport=httpx.MockTransport(fake.handle),
                           async_transport=httpx.MockTransport(fake.ahandle))
    yield c
    c.close()


def test_chat_sends_sampling_params_and_fills_every_completion_field(client, fake):
    fake.adapters["writer@v3"] = "/reg/writer/v3"
    req = ChatRequest(messages=[{"role": "user", "content": "hello"}], agent="writer", max_tokens=3,
                      temperature=0.7, top_p=0.9, stop=["\n\n"], seed=11)
    out = client.chat(req, "writer@v3")

    method, path, body = fake.requests[-1]
    assert (method, path) == ("POST", "/v1/chat/completions")
    assert body == {"model": "writer@v3", "messages": req.messages, "max_tokens": 3, "temperature": 0.7,
                    "top_p": 0.9, "logprobs": True, "return_token_ids": True, "stop": ["\n\n"], "seed": 11}
    assert out.text == "writer@v3:hello"
    assert out.prompt_token_ids == [1, 2, 3, 5]
    assert out.completion_token_ids == [100, 101, 102]
    assert out.logprobs == [-0.5, -1.0, -1.5]
    assert out.finish_reason == "length"
    assert (out.agent, out.adapter_version, out.model) == ("writer", "v3", "writer@v3")
    assert out.extra["usage"]["completion_tokens"] == 3
    assert out.latency_s > 0


def test_optional_fields_left_out_and_agent_from_model_name(client, fake):
    fake.adapters["planner@v1"] = "/p"
    out = client.chat(ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=1), "planner@v1")
    body = fake.requests[-1][2]
    assert "stop" not in body and "seed" not in body
    assert (out.agent, out.adapter_version) == ("planner", "v1")
    base = client.chat(ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=1), BASE)
    assert (base.agent, base.adapter_version, base.model) == (None, None, BASE)


def test_base_url_and_api_key(fake):
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((str(request.url), request.headers.get("authorization")))
        return fake.handle(request)

    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        with OpenAIEngineClient(url, api_key="k", transport=httpx.MockTransport(handler)) as c:
            c.models()
    assert seen == [("http://h:1/v1/models", "Bearer k")] * 4
    with OpenAIEngineClient("http://h:1", transport=httpx.MockTransport(handler)) as c:
        c.models()
    assert seen[-1][1] is None


def test_latency_measures_the_round_trip(fake):
    def slow(request):
        time.sleep(0.05)
        return fake.handle(request)

    with OpenAIEngineClient("http://h:1", transport=httpx.MockTransport(slow)) as c:
        out = c.chat(ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=1), BASE)
    assert out.latency_s >= 0.05


def test_unknown_model_is_404_listing_known_models(client, fake):
    fake.adapters["writer@v1"] = "/w"
    with pytest.raises(UnknownAgentError) as info:
        client.chat(ChatRequest(messages=[{"role": "user", "content": "x"}]), "nobody@v2")
    assert info.value.known == sorted([BASE, "writer@v1"])
    assert "nobody@v2" in str(info.value) and "writer@v1" in str(info.value)


def test_context_length_400_becomes_context_length_error(client):
    req = ChatRequest(messages=[{"role": "user", "content": "y" * 500}], agent="writer", max_tokens=64)
    with pytest.raises(ContextLengthError) as info:
        client.chat(req, BASE)
    err = info.value
    assert (err.max_context, err.prompt_tokens, err.max_tokens) == (2048, 2049, 64)
    assert "reduce the length" in str(err)  # the server's own reason is kept
    assert isinstance(err, ValueError)


def test_embedded_server_context_message_is_parsed_too():
    msg = ("this model's maximum context length is 512 tokens, but the request for agent 'w' has 600 prompt "
           "tokens and asks for 32 more (632); shorten the messages or lower max_tokens")
    transport = httpx.MockTransport(lambda r: httpx.Response(400, json={"error": {"message": msg, "code": 400}}))
    with OpenAIEngineClient("http://h:1", transport=transport) as c, pytest.raises(ContextLengthError) as info:
        c.chat(ChatRequest(messages=[{"role": "user", "content": "x"}]), "w")
    assert (info.value.max_context, info.value.prompt_tokens, info.value.max_tokens) == (512, 600, 32)


@pytest.mark.parametrize("status,body,expected", [
    (400, error_body("temperature must be non-negative, got -1.0.", 400), "temperature must be non-negative"),
    (422, {"detail": [{"loc": ["body", "messages"], "msg": "Field required"}]}, "Field required"),
    (500, "engine dead", "engine dead"),
    (401, {"error": "Unauthorized"}, "check the api_key"),
])
def test_other_http_errors_carry_status_and_reason(status, body, expected):
    def handler(request):
        return httpx.Response(status, json=body) if not isinstance(body, str) else httpx.Response(status, text=body)

    with OpenAIEngineClient("http://h:1", transport=httpx.MockTransport(handler)) as c, \
            pytest.raises(ServerRequestError) as info:
        c.chat(ChatRequest(messages=[{"role": "user", "content": "x"}]), BASE)
    assert info.value.status_code == status
    assert expected in str(info.value) and "/v1/chat/completions" in str(info.value)


@pytest.mark.parametrize("mutate,missing", [
    (lambda d: d["choices"][0].update(token_ids=None), "choices[0].token_ids"),
    (lambda d: d.update(prompt_token_ids=None), "prompt_token_ids"),
    (lambda d: d["choices"][0].update(logprobs=None), "choices[0].logprobs.content"),
    (lambda d: d.update(choices=[]), "no choices[0]"),
    (lambda d: d["choices"][0]["logprobs"]["content"].pop(), "2 completion token ids but 1 logprobs"),
])
def test_responses_without_token_ids_or_logprobs_are_refused(mutate, missing):
    data = vllm_chat_response(BASE, [1], [5, 6], [-1.0, -2.0])
    mutate(data)
    with OpenAIEngineClient("http://h:1", transport=httpx.MockTransport(lambda r: httpx.Response(200, json=data))) \
            as c, pytest.raises(MalformedResponseError, match=missing.replace("[", r"\[").replace("]", r"\]")):
        c.chat(ChatRequest(messages=[{"role": "user", "content": "x"}]), BASE)


def test_no_server_is_a_clear_unavailable_error():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    with OpenAIEngineClient("http://127.0.0.1:9", transport=httpx.MockTransport(refuse),
                            async_transport=httpx.MockTransport(refuse)) as c:
        assert c.health() is False
        with pytest.raises(ServerUnavailableError, match="is the server running"):
            c.chat(ChatRequest(messages=[{"role": "user", "content": "x"}]), BASE)
        with pytest.raises(ServerUnavailableError):
            c.models()
        with pytest.raises(ServerUnavailableError):
            asyncio.run(c.achat(ChatRequest(messages=[{"role": "user", "content": "x"}]), BASE))


def test_health_and_models(client, fake):
    assert client.health() is True
    assert client.models() == [BASE]
    assert client.model_cards()[0]["max_model_len"] == 2048


def test_load_and_unload_lora_adapter(client, fake, tmp_path):
    client.load_lora_adapter("writer@v1", tmp_path)
    assert fake.requests[-1] == ("POST", "/v1/load_lora_adapter", {"lora_name": "writer@v1", "lora_path": str(tmp_path)})
    assert "writer@v1" in client.models()

    with pytest.raises(ServerRequestError, match="already been loaded") as info:
        client.load_lora_adapter("writer@v1", tmp_path / "v2")
    assert info.value.status_code == 400 and "writer@v1" in str(info.value)
    client.load_lora_adapter("writer@v1", tmp_path / "v2", load_inplace=True)
    assert fake.adapters["writer@v1"] == str(tmp_path / "v2")

    client.unload_lora_adapter("writer@v1")
    assert client.models() == [BASE]
    with pytest.raises(UnknownAgentError, match="writer@v1"):
        client.unload_lora_adapter("writer@v1")


def test_achat_and_achat_many_keep_request_order(fake):
    fake.delay_s = 0.05
    fake.adapters.update({"a@v1": "/a", "b@v1": "/b"})
    c = OpenAIEngineClient("http://h:1", async_transport=httpx.MockTransport(fake.ahandle))
    reqs = [ChatRequest(messages=[{"role": "user", "content": f"q{i}"}], max_tokens=i + 1, seed=i) for i in range(6)]
    models = ["a@v1", BASE, "b@v1", "a@v1", BASE, "b@v1"]

    one = asyncio.run(c.achat(reqs[0], "a@v1"))
    assert one.text == "a@v1:q0" and one.completion_token_ids == [100]

    outs = asyncio.run(c.achat_many(reqs, models, max_concurrency=3))
    assert [o.text for o in outs] == [f"{m}:q{i}" for i, m in enumerate(models)]
    assert [len(o.completion_token_ids) for o in outs] == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ValueError, match="2 requests but 1 model"):
        asyncio.run(c.achat_many(reqs[:2], models[:1]))


def test_achat_many_raises_the_failure_after_all_finish(fake):
    fake.adapters["a@v1"] = "/a"
    c = OpenAIEngineClient("http://h:1", async_transport=httpx.MockTransport(fake.ahandle))
    reqs = [ChatRequest(messages=[{"role": "user", "content": "q"}], max_tokens=1, seed=i) for i in range(3)]
    with pytest.raises(UnknownAgentError, match="ghost") as info:
        asyncio.run(c.achat_many(reqs, ["a@v1", "ghost", BASE]))
    assert info.value.known == sorted([BASE, "a@v1"])
    chats = [r for r in fake.requests if r[1] == "/v1/chat/completions"]
    assert len(chats) == 3


def test_extra_body_adds_engine_specific_fields(client, fake):
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], max_tokens=2)
    client.chat(req, BASE, extra_body={"ignore_eos": True, "top_k": 5})
    assert fake.requests[-1][2]["ignore_eos"] is True and fake.requests[-1][2]["top_k"] == 5
    asyncio.run(client.achat_many([req], [BASE], extra_body={"ignore_eos": True}))
    assert fake.requests[-1][2]["ignore_eos"] is True and "top_k" not in fake.requests[-1][2]


def test_a_missing_route_is_not_reported_as_an_unknown_model():
    def handler(request):  # e.g. base_url points at some other service
        return httpx.Response(404, json={"detail": "Not Found"})

    with OpenAIEngineClient("http://h:1/api", transport=httpx.MockTransport(handler),
                            async_transport=httpx.MockTransport(handler)) as c:
        for call in (lambda: c.chat(ChatRequest(messages=[{"role": "user", "content": "x"}]), BASE),
                     lambda: asyncio.run(c.achat(ChatRequest(messages=[{"role": "user", "content": "x"}]), BASE))):
            with pytest.raises(ServerRequestError, match="Not Found.*server's address") as info:
                call()
            assert info.value.status_code == 404
            assert not isinstance(info.value, UnknownAgentError)


def test_unpinned_role_takes_the_version_the_server_says_answered(client):
    """`marft-lg serve` answers an unpinned role with its current version and says which in `marft`."""
    data = {"model": "writer", "prompt_token_ids": [1], "marft": {"agent": "writer", "adapter_version": "v7"},
            "choices": [{"message": {"content": "hi"}, "token_ids": [5], "finish_reason": "stop",
                         "logprobs": {"content": [{"token": "hi", "logprob": -0.25}]}}]}
    req = ChatRequest(messages=[{"role": "user", "content": "x"}], agent="writer")
    assert client._to_completion(data, req, "writer", 0.01).adapter_version == "v7"
    pinned = client._to_completion({**data, "marft": {"adapter_version": "v7"}}, req, "writer@v2", 0.01)
    assert pinned.adapter_version == "v2"
    assert client._to_completion({k: v for k, v in data.items() if k != "marft"}, req, "writer", 0.01).adapter_version is None
