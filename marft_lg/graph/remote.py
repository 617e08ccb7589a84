"""`RemoteEngine`: the `ChatEngine` view of an OpenAI-compatible server (``marft-lg serve`` or vLLM).

Each request goes to the served model named after its agent: ``role@version`` when a version is
pinned, ``role`` for the role's current adapter, the base model's name when no agent answers.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from marft_lg.serving.types import ChatRequest, Completion, TokenListener


class RemoteEngine:
    """Adapt `OpenAIEngineClient` (one request, one model name) to the batched `ChatEngine` protocol."""

    def __init__(self, client_or_url: Any, api_key: str | None = None, *, models_ttl_s: float = 5.0):
        if isinstance(client_or_url, str):
            from marft_lg.serving.http.client import OpenAIEngineClient

            client_or_url = OpenAIEngineClient(client_or_url, api_key=api_key)
        self.client = client_or_url
        self.models_ttl_s = models_ttl_s
        self._models: list[str] = []
        self._models_at = float("-inf")
        self._lock = threading.Lock()

    def _served(self) -> list[str]:
        with self._lock:
            if time.monotonic() - self._models_at > self.models_ttl_s:
                self._models = self.client.models()
                self._models_at = time.monotonic()
            return list(self._models)

    @property
    def model_name(self) -> str:
        served = self._served()
        return served[0] if served else self.client.base_url

    def agents(self) -> list[str]:
        """Roles the server answers for: every served name but the base model, without ``@version``."""
        return list(dict.fromkeys(name.partition("@")[0] for name in self._served()[1:]))

    def versions(self) -> dict[str, str]:
        """Versions are the server's business; only pinned ``role@version`` names are known here."""
        return {}

    def served_name(self, request: ChatRequest) -> str:
        if request.agent is None:
            return self.model_name
        return f"{request.agent}@{request.version}" if request.version else request.agent

    def chat(self, requests: list[ChatRequest]) -> list[Completion]:
        return [self.client.chat(r, self.served_name(r)) for r in requests]

    async def achat(self, requests: list[ChatRequest],
                    listeners: list[TokenListener | None] | None = None) -> list[Completion]:
        """The server's answers; `listeners[i]` hears request i's tokens as the server streams them."""
        names = await asyncio.to_thread(lambda: [self.served_name(r) for r in requests])
        return list(await self.client.achat_many(requests, names, listeners=listeners))

    def close(self) -> None:
        self.client.close()
