"""A stand-in for an external OpenAI-compatible endpoint (a hosted API marft_lg does not train), for tests.

`FakeOpenAIServer(reply=lambda messages: "...")` serves ``POST /v1/chat/completions`` (non-streaming and
streaming), ``GET /v1/models`` and ``GET /health`` on 127.0.0.1 from a thread; use it as a context manager
(`base_url` ends in ``/v1``). Replies carry `usage` and no log-probs, as a hosted API's would.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = Callable[[list[dict[str, Any]]], str]


class FakeOpenAIServer:
    def __init__(self, reply: Reply = lambda messages: "OK.", *, model: str = "external-model"):
        self.reply, self.model = reply, model
        self.requests: list[dict[str, Any]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "start the server first"
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> FakeOpenAIServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.rstrip("/").endswith("/models"):
                    self._send(200, json.dumps({"object": "list", "data": [
                        {"id": owner.model, "object": "model", "owned_by": "external"}]}).encode())
                elif self.path == "/health":
                    self._send(200, b"{}")
                else:
                    self._send(404, b'{"error": "not found"}')

            def do_POST(self) -> None:  # noqa: N802
                if not self.path.rstrip("/").endswith("/chat/completions"):
                    self._send(404, b'{"error": "not found"}')
                    return
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                owner.requests.append(body)
                text = owner.reply(body.get("messages") or [])
                cid, now, model = f"chatcmpl-{uuid.uuid4().hex[:12]}", int(time.time()), body.get("model", owner.model)
                usage = {"prompt_tokens": sum(len(str(m.get("content", "")).split()) for m in body.get("messages", [])),
                         "completion_tokens": len(text.split())}
                usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
                if body.get("stream"):
                    chunks = [{"id": cid, "object": "chat.completion.chunk", "created": now, "model": model,
                               "choices": [{"index": 0, "delta": {"role": "assistant", "content": text},
                                            "finish_reason": None}]},
                              {"id": cid, "object": "chat.completion.chunk", "created": now, "model": model,
                               "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}]
                    data = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
                    self._send(200, data.encode(), "text/event-stream")
                    return
                self._send(200, json.dumps({
                    "id": cid, "object": "chat.completion", "created": now, "model": model, "usage": usage,
                    "choices": [{"index": 0, "finish_reason": "stop", "logprobs": None,
                                 "message": {"role": "assistant", "content": text}}]}).encode())

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
