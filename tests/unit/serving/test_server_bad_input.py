"""The server holds under bad input: oversized bodies, hostile JSON, huge prompts, internal errors, and
`marft-lg serve`'s start-up checks. Errors keep the OpenAI shape ``{"error": {message, type, param, code}}``."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import pytest
import torch
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from marft_lg.serving.http.server import create_app
from marft_lg.serving.http.transport import MAX_JSON_DEPTH
from marft_lg.serving.registry.lora import LoraSettings
from marft_lg.serving.team import Team
from tests.servers import uvicorn_thread

MSG = [{"role": "user", "content": "Say hi."}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def team(tiny_model_dir):
    torch.set_num_threads(1)
    t = Team(tiny_model_dir, ["planner", "writer"], lora=LoraSettings(r=4, init=False), versions=None, model_name="tiny")
    yield t
    t.close()


@pytest.fixture(scope="module")
def client(team):
    with TestClient(create_app(team, max_body_bytes=64 * 1024)) as c:
        yield c


def _openai_error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body["error"]) == ERROR_KEYS and body["error"]["code"] == status and body["error"]["message"]
    assert r.headers["x-request-id"]
    return body["error"]


def test_a_body_over_the_limit_is_413_before_it_is_read(client):
    err = _openai_error(client.post("/v1/chat/completions", content=b"x" * (64 * 1024 + 1),
                                    headers={"content-type": "application/json"}), 413)
    assert "65536 bytes" in err["message"] and "--max-body-mb" in err["message"]

    def chunks():  # no Content-Length: counted as it streams in
        for _ in range(40):
            yield b" " * 4096

    _openai_error(client.post("/v1/chat/completions", content=chunks()), 413)
    # A declared Content-Length over the limit is answered without a single receive() call.
    app = client.app
    received, sent = [], []

    async def receive():
        received.append(1)
        raise AssertionError("the body must not be read")

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "headers": [(b"content-length", str(20 * 2**20).encode())], "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "root_path": ""}
    asyncio.run(app(scope, receive, send))
    assert received == [] and sent[0]["status"] == 413
    assert client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "max_tokens": 1}).status_code == 200


def test_health_answers_while_a_20mb_request_is_in_flight(team):
    """The request's headers and first megabyte are in; /health answers meanwhile; the request gets 413.
    (Measured latencies and RSS are in docs/serving.md; this only checks the overlap.)"""
    app = create_app(team)  # default 8 MB limit
    go_on = threading.Event()
    outcome: dict[str, object] = {}

    def body():
        yield b'{"model": "planner", "messages": [{"role": "user", "content": "' + b"x" * 2**20
        go_on.wait(30)
        for _ in range(19):
            yield b"x" * 2**20
        yield b'"}]}'

    with uvicorn_thread(app) as url:
        def big():
            try:
                outcome["status"] = httpx.post(f"{url}/v1/chat/completions", content=body(), timeout=60).status_code
            except httpx.HTTPError as e:  # pragma: no cover - reported by the assertion below
                outcome["status"] = repr(e)

        sender = threading.Thread(target=big)
        sender.start()
        try:
            time.sleep(0.3)
            assert sender.is_alive() and "status" not in outcome  # still in flight
            health = httpx.get(f"{url}/health", timeout=10)
            assert health.status_code == 200 and health.json() == {"status": "ok"}
            assert "status" not in outcome  # answered while the big request was still being sent
        finally:
            go_on.set()
            sender.join(60)
        assert outcome["status"] == 413
        declared = httpx.post(f"{url}/v1/chat/completions", content=b"x" * (20 * 2**20), timeout=60)
        assert declared.status_code == 413
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


@pytest.mark.parametrize("depth", [1000, 5000])
def test_deep_json_is_400_in_the_openai_shape(client, depth):
    for raw in ("[" * depth + "]" * depth,
                '{"model": "planner", "messages": ' + '{"a": ' * depth + "1" + "}" * depth + "}"):
        for path in ("/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            err = _openai_error(client.post(path, content=raw, headers={"content-type": "application/json"}), 400)
            assert "deeper than" in err["message"] or "depth limit" in err["message"] or "not valid JSON" in err["message"]
    shallow = '{"model": "planner", "messages": ' + "[" * (MAX_JSON_DEPTH - 2) + "]" * (MAX_JSON_DEPTH - 2) + "}"
    err = _openai_error(client.post("/v1/chat/completions", content=shallow), 400)  # parsed, then refused as a value
    assert err["param"] == "messages" or "messages" in err["message"]


def test_lone_surrogates_are_400_in_the_openai_shape(client):
    escaped = '{"model": "planner", "messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}'
    raw_bytes = b'{"model": "planner", "messages": [{"role": "user", "content": "\xed\xa0\x80"}], "max_tokens": 2}'
    for body in (escaped.encode(), raw_bytes, b'{"model": "planner", "stop": "\\udfff", "messages": []}'):
        err = _openai_error(client.post("/v1/chat/completions", content=body,
                                        headers={"content-type": "application/json"}), 400)
        assert "not valid JSON" in err["message"]
    ok = '{"model": "planner", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'
    assert client.post("/v1/chat/completions", content=ok).status_code == 200  # a valid pair is fine


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(client, team, monkeypatch):
    calls = []
    real = team.engine.encode
    monkeypatch.setattr(team.engine, "encode", lambda req: calls.append(1) or real(req))
    bound = team.engine.max_context() * team.engine.max_token_chars
    text = "y" * (bound // 2)  # 2 messages: more characters than max_context tokens can hold
    big = create_app(team, max_body_bytes=4 * bound)
    with TestClient(big) as c:
        r = c.post("/v1/chat/completions", json={"model": "planner", "max_tokens": 1,
                                                 "messages": [{"role": "user", "content": text}] * 2 + MSG})
    err = _openai_error(r, 400)
    assert "maximum context length" in err["message"] and "characters" in err["message"]
    assert calls == []
    r = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 200 and calls == [1]


def test_tokenizing_runs_off_the_event_loop(client, team, monkeypatch):
    seen = []
    real = team.engine.encode

    def encode(req):
        try:
            asyncio.get_running_loop()
            seen.append("event loop")
        except RuntimeError:
            seen.append("worker thread")
        return real(req)

    monkeypatch.setattr(team.engine, "encode", encode)
    r = client.post("/v1/chat/completions", json={"model": "writer", "messages": MSG, "max_tokens": 1})
    assert r.status_code == 200 and seen == ["worker thread"]


def test_an_unexpected_exception_is_a_json_500_with_a_request_id(client, team, monkeypatch, caplog):
    async def boom(requests):
        raise RuntimeError("engine on fire")

    monkeypatch.setattr(team, "achat", boom)
    with caplog.at_level(logging.ERROR, logger="marft_lg.serving.http.server"):
        r = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "max_tokens": 1})
        tagged = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG},
                             headers={"x-request-id": "req-42"})
    err = _openai_error(r, 500)
    rid = r.headers["x-request-id"]
    assert r.json()["request_id"] == rid and rid in err["message"] and "RuntimeError" in err["message"]
    assert "engine on fire" not in err["message"]  # internals stay in the log
    assert tagged.status_code == 500 and tagged.headers["x-request-id"] == "req-42"
    failed = [rec for rec in caplog.records if rid in rec.getMessage()]
    assert failed and failed[0].exc_info and "engine on fire" in str(failed[0].exc_info[1])
    assert client.get("/health").headers["x-request-id"]  # every response carries one

    async def group(requests):  # what a task group re-raises
        raise ExceptionGroup("batch", [RuntimeError("one"), ValueError("two")])

    monkeypatch.setattr(team, "achat", group)
    r = client.post("/v1/chat/completions", json={"model": "planner", "messages": MSG, "max_tokens": 1})
    assert "ExceptionGroup" in _openai_error(r, 500)["message"]


def _serve_cli():
    from marft_lg.serving.commands import serve

    app = typer.Typer()
    app.command("serve")(serve)
    app.command("noop")(lambda: None)
    return app


def _one_line_exit_2(r) -> str:
    assert r.exit_code == 2, (r.exit_code, r.output)
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("marft-lg serve: "), r.output
    return lines[0]


def test_serve_refuses_a_non_loopback_host_without_an_api_key(monkeypatch, tmp_path):
    import marft_lg.serving.commands as commands

    runner, app = CliRunner(), _serve_cli()
    line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--host", "0.0.0.0"], env={}))
    assert "refusing to bind 0.0.0.0 without --api-key" in line and "--insecure-no-auth" in line
    assert commands._is_loopback("127.0.0.1") and commands._is_loopback("::1") and commands._is_loopback("localhost")
    assert not commands._is_loopback("0.0.0.0") and not commands._is_loopback("example.org")

    def no_bind(host, port):  # past the auth check: stop before anything listens on a public address
        raise OSError(13, "Permission denied")

    monkeypatch.setattr(commands, "_bind", no_bind)
    for extra in (["--insecure-no-auth"], ["--api-key", "k"]):
        line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--host", "0.0.0.0", *extra], env={}))
        assert line == "marft-lg serve: cannot listen on 0.0.0.0:8000: Permission denied"


def test_serve_start_up_errors_are_one_line_and_exit_2(tiny_model_dir, tmp_path):
    runner, app = CliRunner(), _serve_cli()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--model", tiny_model_dir,
                                                    "--port", str(port)]))
        assert f"cannot listen on 127.0.0.1:{port}" in line and "in use" in line
    line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--model", str(tmp_path / "nope"),
                                                "--port", "0"]))
    assert str(tmp_path / "nope") in line and "config.json" in line
    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "aliases.json").write_text('{"aliases": {"live": {"planner": "v')  # truncated
    line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--model", tiny_model_dir,
                                                "--registry", str(registry), "--port", "0"]))
    assert f"corrupt alias file {registry / 'aliases.json'}" in line
    (tmp_path / "afile").write_text("")
    line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--model", tiny_model_dir,
                                                "--registry", str(tmp_path / "afile"), "--port", "0"]))
    assert "is not a directory" in line
    lora = tmp_path / "lora.yaml"
    lora.write_text("r: 4\nalpha: -1\n")
    line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--model", tiny_model_dir,
                                                "--lora", str(lora), "--port", "0"]))
    assert line == f"marft-lg serve: {lora}:2: alpha: must be > 0, got -1"
    line = _one_line_exit_2(runner.invoke(app, ["serve", "--agents", "planner", "--versions", "planner=v1,writer",
                                                "--port", "0"]))
    assert "'writer' is not role=ref" in line


def test_out_of_range_numbers_are_400(client):
    for body in ('{"model": "planner", "messages": [{"role": "user", "content": "x"}], "seed": 18446744073709551615}',
                 '{"model": "planner", "messages": [{"role": "user", "content": "x"}], "seed": 1e300}',
                 '{"model": "planner", "messages": [{"role": "user", "content": "x"}], "max_tokens": NaN}'):
        _openai_error(client.post("/v1/chat/completions", content=body), 400)


def test_request_guard_keeps_errors_json_for_every_endpoint(client):
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/chat/completions"):
        _openai_error(client.post(path, content=b"\xff\xfe not json"), 400)
        _openai_error(client.post(path, content=json.dumps(["not", "an", "object"])), 400)
