"""A team's OpenAI-compatible server on a loopback port inside this process, for apps that call their agents over
HTTP (a LangChain `ChatOpenAI`, the `openai` client) while marft_lg runs them on-policy or in a comparison.

The app runs unchanged: the episode's calls for the team's roles are sent here (`redirect`, applied by
`tracing.propagation` to the requests made inside a wrapped episode), whatever URL the app was built with, so
they reach the adapters under test with the episode's version pins and seeds; calls for any other model (an
external API the team does not serve) go where the app sent them. What the server samples is recorded into the
wrapped app's own trace sink, beside the app's spans.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from marft_lg.serving.http.served_spans import ServedRecorder
from marft_lg.serving.types import ServedTeam
from marft_lg.tracing.propagation import is_llm_call, rewrite_origin


class LocalServer:
    """`create_app(team)` behind uvicorn on 127.0.0.1 in a daemon thread, started on first use (`base_url`)."""

    def __init__(self, team: ServedTeam, sink: Any, *, capture_messages: bool = True, start_timeout_s: float = 30.0,
                 engine_for: Any = None):
        self.team = team
        self.engine_for = engine_for  # `create_app`'s: a counterfactual replay's engine for its episode's calls
        self.recorder = ServedRecorder(sink, capture_messages=capture_messages)
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None
        self.redirected = 0

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:<port>/v1``, starting the server the first time it is asked for."""
        with self._lock:
            if self._url is None:
                self._url = self._start()
            return self._url

    def _start(self) -> str:
        import socket

        import uvicorn

        from marft_lg.serving.http.server import create_app

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(create_app(self.team, recorder=self.recorder, engine_for=self.engine_for), log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="marft-local-server", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                server.should_exit = True
                sock.close()
                raise RuntimeError(f"the team's loopback server on port {port} did not start within "
                                   f"{self.start_timeout_s:.0f}s")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        return f"http://127.0.0.1:{port}/v1"

    def serves(self, model: Any) -> bool:
        """Whether a request for `model` (``role``, ``role@version`` or a base model name) is the team's to answer."""
        if not isinstance(model, str):
            return False
        return model.partition("@")[0] in self.team.agents() or model in getattr(self.team, "bases", {})

    def redirect(self, request: Any) -> None:
        """Send an httpx request here when it is a chat completion for one of the team's models."""
        if not is_llm_call(request):
            return
        try:
            model = json.loads(request.content).get("model")
        except (ValueError, AttributeError, TypeError, UnicodeDecodeError):
            return
        except Exception:  # noqa: BLE001 - a streamed body that was not read: not ours to look at
            return
        if self.serves(model):
            rewrite_origin(request, self.base_url)
            self.redirected += 1

    def close(self) -> None:
        with self._lock:
            server, thread, self._server, self._thread, self._url = self._server, self._thread, None, None, None
        if server is not None:
            server.should_exit = True
            if thread is not None:
                thread.join(timeout=10)
