"""A stand-in for an external OpenAI-compatible endpoint: the hosted API the frozen planner calls, which
marft_lg neither serves nor trains.

    python external.py --port 8001        # then EXTERNAL_BASE_URL=http://127.0.0.1:8001/v1

`ExternalEndpoint(reply=lambda messages: "...")` serves ``POST /v1/chat/completions`` (plain and streaming),
``GET /v1/models`` and ``GET /health`` on 127.0.0.1 from a thread; use it as a context manager (`base_url`
ends in ``/v1``). Replies carry `usage` and no log-probs or token ids, as a hosted API's would. The default
reply is a scripted planner's one-line plan; tests pass their own `reply`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Reply = Callable[[list[dict[str, Any]]], str]
PLANS = {"plus": "add the two numbers", "minus": "subtract the second number from the first",
         "times": "multiply the two numbers"}


def plan(messages: list[dict[str, Any]]) -> str:
    """A planner's one-line plan for the last user message: which operation to apply to which numbers."""
    text = str(messages[-1].get("content", "")) if messages else ""
    numbers = re.findall(r"\d+", text)
    op = next((p for word, p in PLANS.items() if word in text), "work out the result")
    return f"Plan: {op} ({' and '.join(numbers) or 'the numbers'}), then state the result."


class ExternalEndpoint:
    def __init__(self, reply: Reply = plan, *, model: str = "external-planner", port: int = 0):
        self.reply, self.model, self.port = reply, model, port
        self.requests: list[dict[str, Any]] = []
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        assert self._server is not None, "start the server first"
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> ExternalEndpoint:
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

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def main() -> None:
    ap = argparse.ArgumentParser(description="a stand-in hosted chat API (OpenAI-compatible) on 127.0.0.1")
    ap.add_argument("--port", type=int, default=8001)
    args = ap.parse_args()
    with ExternalEndpoint(port=args.port) as endpoint:
        print(f"external planner API on {endpoint.base_url}", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
