"""Token streaming, cancellation and timeouts of `marft-lg serve` and the engines (issue #32, item 3).

Text reaches a streaming client while the rest is decoded (embedded engine, the HTTP client that also talks to
vLLM, `TeamChatModel`, ChatOpenAI); a client that hangs up, streaming or not, frees its rows at the next decode step;
slow clients and long generations are timed out.
"""

from __future__ import annotations

import asyncio
import functools
import json
import operator
import socket
import statistics
import time

import httpx
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from marft_lg.serving.engine.streaming import TextDeltas
from marft_lg.serving.http.client import OpenAIEngineClient
from marft_lg.serving.http.server import create_app
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from marft_lg.serving.types import ChatRequest
from marft_lg.tracing.attributes import RESPONSE_METADATA_KEY
from tests.servers import uvicorn_thread

MSG = [{"role": "user", "content": "Tell me a long story about a cat."}]


def _bytes_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


# ---- TextDeltas: what may be shown before the end ---------------------------------------------------------------
def test_half_a_utf8_character_waits_for_its_other_half():
    texts = TextDeltas(_bytes_decode)
    e_acute = list("é".encode())
    assert texts.push([ord("a")]) == "a"
    assert texts.push(e_acute[:1]) == ""
    assert texts.push(e_acute[1:]) == "é"
    assert texts.finish("aé") == ""


def test_a_stop_string_is_never_shown_even_in_part():
    texts = TextDeltas(_bytes_decode, stop=["END"])
    shown = texts.push(list(b"abcE")) + texts.push(list(b"N")) + texts.push(list(b"D!"))
    assert shown == "abc"
    assert texts.finish("abc") == ""


def test_with_tools_a_tool_call_block_is_held_back_and_the_parsed_content_completes_the_text():
    texts = TextDeltas(_bytes_decode, tools=True)
    shown = texts.push(list(b"Sure, ")) + texts.push(list(b"calling <tool")) + texts.push(list(b'_call>{"name": "add"'))
    assert shown == "Sure, calling"
    assert texts.push(list(b', "arguments": {}}</tool_call>')) == ""
    assert shown + texts.finish("Sure, calling") == "Sure, calling"


@given(st.text(max_size=40), st.lists(st.integers(0, 40), max_size=6), st.sampled_from([None, ["zz"], ["\n\n"]]))
def test_the_pieces_add_up_to_the_finished_text(text, cuts, stop):
    data = list(text.encode())
    final = text[: text.find(stop[0])] if stop and stop[0] in text else text
    texts = TextDeltas(_bytes_decode, stop=stop)
    shown, at = "", 0
    for cut in sorted(min(c, len(data)) for c in cuts) + [len(data)]:
        shown += texts.push(data[at:cut])
        at = cut
    assert final.startswith(shown)
    assert shown + texts.finish(final) == final


# ---- the server ------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def team(tiny_model_dir):
    torch.set_num_threads(1)
    t = Team(tiny_model_dir, ["planner"], lora=LoraSettings(r=4, init=False), versions=None, model_name="tiny",
             engine_options={"max_batch_size": 4})
    yield t
    t.close()


@pytest.fixture(scope="module")
def url(team):
    with uvicorn_thread(create_app(team, read_timeout_s=1.0)) as base:
        yield base


def _events(lines) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_the_first_text_arrives_while_the_rest_is_still_decoded(team, url):
    body = {"model": "planner", "messages": MSG, "max_tokens": 400, "ignore_eos": True, "seed": 3, "logprobs": True,
            "return_token_ids": True}
    whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()
    answered = team.engine.stats["requests"]
    chunks, answered_at_first_text = [], None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            chunks += _events([line])
            if answered_at_first_text is None and any(c["delta"].get("content") for e in chunks[-1:]
                                                      for c in e.get("choices", [])):
                answered_at_first_text = team.engine.stats["requests"]
    assert answered_at_first_text == answered, "the first text came only after the completion was answered"
    content = [c for e in chunks for c in e["choices"] if c["delta"].get("content")]
    assert len(content) > 10  # pieces, not one block
    choices = [c for e in chunks for c in e["choices"]]
    assert "".join(c["delta"].get("content") or "" for c in choices) == whole["choices"][0]["message"]["content"]
    ids = [t for c in choices for t in c.get("token_ids") or []]
    assert ids == whole["choices"][0]["token_ids"]
    entries = [x for c in choices for x in (c.get("logprobs") or {}).get("content") or []]
    assert [x["logprob"] for x in entries] == pytest.approx([x["logprob"] for x in whole["choices"][0]["logprobs"]["content"]], abs=1e-4)
    last = [e for e in chunks if e.get("prompt_token_ids")]
    assert last and last[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert chunks[-1]["usage"]["completion_tokens"] == 400


def _post_and_abandon(port: int, body: dict) -> socket.socket:
    raw = json.dumps(body).encode()
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    return s


def _latency(url: str) -> float:
    body = {"model": "planner", "messages": MSG, "max_tokens": 96, "ignore_eos": True, "seed": 1}
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200
    return time.perf_counter() - t0


def test_abandoned_requests_free_their_rows_and_a_normal_request_keeps_its_latency(team, url):
    unloaded = statistics.median(_latency(url) for _ in range(3))
    cancelled = team.engine.stats["cancelled"]
    port = int(url.rsplit(":", 1)[1])
    long = {"model": "planner", "messages": MSG, "max_tokens": 1500, "ignore_eos": True}
    socks = [_post_and_abandon(port, {**long, "stream": k % 2 == 0, "seed": k}) for k in range(24)]
    deadline = time.monotonic() + 30
    while team.engine.stats["joined_running"] + team.engine.stats["batches"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)  # the batch is full of them, the rest queued behind
    for s in socks:
        s.close()
    loaded = _latency(url)
    assert loaded <= 2 * unloaded, f"normal request took {loaded:.2f}s after abandoned ones, {unloaded:.2f}s unloaded"
    deadline = time.monotonic() + 10
    while team.engine.stats["cancelled"] - cancelled < 24 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert team.engine.stats["cancelled"] - cancelled == 24  # every one, running or queued, streaming or not


def test_a_client_that_drip_feeds_its_request_gets_408(url):
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 200\r\n\r\n{\"model\": ")
        s.settimeout(10)
        t0 = time.perf_counter()
        answer = s.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408") and "read timeout of 1 s" in answer
    assert time.perf_counter() - t0 < 5


def test_a_generation_past_the_request_timeout_is_cancelled_with_504(team):
    cancelled = team.engine.stats["cancelled"]
    with uvicorn_thread(create_app(team, request_timeout_s=0.3)) as base:
        body = {"model": "planner", "messages": MSG, "max_tokens": 1500, "ignore_eos": True}
        r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 504 and "--request-timeout" in r.json()["error"]["message"]
        with httpx.stream("POST", f"{base}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as s:
            events = _events(s.iter_lines())
        assert events[-1]["error"]["code"] == 504
    deadline = time.monotonic() + 10
    while team.engine.stats["cancelled"] - cancelled < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert team.engine.stats["cancelled"] - cancelled == 2


def test_a_refused_streaming_request_is_still_a_400(url):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": "planner", "messages": MSG, "stream": True,
                                                        "max_tokens": 10**6}, timeout=30)
    assert r.status_code == 400 and "context" in r.text.lower()


# ---- the clients -------------------------------------------------------------------------------------------------------
def test_the_http_client_streams_and_puts_the_same_completion_together(url):
    client = OpenAIEngineClient(url)
    req = ChatRequest(messages=MSG, agent="planner", max_tokens=60, seed=5, ignore_eos=False)
    heard: list[list[int]] = []
    streamed = asyncio.run(client.achat(req, "planner", listener=lambda ids, lps: heard.append(ids)))
    whole = client.chat(req, "planner")
    assert len(heard) > 5 and [t for ids in heard for t in ids] == streamed.completion_token_ids
    assert streamed.completion_token_ids == whole.completion_token_ids
    assert streamed.text == whole.text and streamed.prompt_token_ids == whole.prompt_token_ids
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-4)
    assert streamed.extra["id"].startswith("chatcmpl-")


def test_team_chat_model_streams_text_as_it_is_decoded(team):
    from marft_lg.graph.chat_model import TeamChatModel

    model = TeamChatModel(team=team, unmapped="base", max_tokens=60, seed=9)
    whole = model.invoke("Tell me about cats.").content
    chunks = list(model.stream("Tell me about cats."))
    assert len([c for c in chunks if c.content]) > 5
    assert "".join(c.content for c in chunks) == whole
    merged = functools.reduce(operator.add, chunks)
    assert len(merged.response_metadata[RESPONSE_METADATA_KEY]["completion_token_ids"]) == merged.usage_metadata["output_tokens"]

    async def astream():
        return [c async for c in model.astream("Tell me about cats.")]

    achunks = asyncio.run(astream())
    assert len([c for c in achunks if c.content]) > 5 and "".join(c.content for c in achunks) == whole


def test_breaking_off_a_team_chat_model_stream_cancels_its_generation(team):
    """A consumer that stops reading a sync stream (a `break`, an exception) frees the request's row at once, as an
    async consumer does: the generation does not run on to max_tokens on the helper thread."""
    from marft_lg.graph.chat_model import TeamChatModel

    model = TeamChatModel(team=team, unmapped="base", max_tokens=1500, seed=3)
    for how in ("sync", "async"):
        cancelled = team.engine.stats["cancelled"]
        if how == "sync":
            stream = model.stream("Tell me a long story about a cat.")
            assert next(c for c in stream if c.content).content
            stream.close()  # what a `for` loop's `break` does to the generator

        else:
            async def first_piece() -> None:
                agen = model.astream("Tell me a long story about a cat.")
                async for chunk in agen:
                    if chunk.content:
                        break
                await agen.aclose()

            asyncio.run(first_piece())
        deadline = time.monotonic() + 10
        while team.engine.stats["cancelled"] == cancelled and time.monotonic() < deadline:
            time.sleep(0.02)
        assert team.engine.stats["cancelled"] == cancelled + 1, how


def test_chatopenai_streams_from_the_server(url):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="planner", base_url=f"{url}/v1", api_key="x", max_tokens=60, seed=2, temperature=1.0)
    whole = llm.invoke("Tell me about dogs.").content
    chunks = list(llm.stream("Tell me about dogs."))
    assert len([c for c in chunks if c.content]) > 5
    assert "".join(c.content for c in chunks) == whole
