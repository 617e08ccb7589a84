"""The one HTTP client for every OpenAI-compatible engine we run: vLLM's server and `marft-lg serve`.

It asks for exactly what the trainer needs (`logprobs: true`, `return_token_ids: true`) and turns
the response into a `Completion` with the engine's own token ids. HTTP errors become the serving
layer's exceptions, so callers handle one set of errors whichever engine answers.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from marft_lg.constraints import vllm_fields
from marft_lg.serving.errors import ContextLengthError, ServingError, UnknownAgentError
from marft_lg.serving.types import ChatRequest, Completion, TokenListener

DEFAULT_TIMEOUT_S = 600.0


class ServerRequestError(ServingError, RuntimeError):
    """The server refused or failed a request; `status_code` and the server's own reason are kept."""

    def __init__(self, message: str, *, status_code: int | None = None, body: Any = None):
        self.status_code, self.body = status_code, body
        super().__init__(message)


class ServerUnavailableError(ServerRequestError):
    """Nothing answered at the base URL (server not started, crashed, or wrong host/port)."""


class MalformedResponseError(ServerRequestError):
    """The server answered 200 but without a field the trainer needs (token ids, logprobs)."""


_CTX_PATTERNS = (
    re.compile(r"maximum context length is (\d+) tokens.*?contains (?:at least )?(\d+) input tokens", re.I | re.S),
    re.compile(r"maximum context length is (\d+) tokens.*?has (\d+) prompt tokens and asks for (\d+)", re.I | re.S),
)


def _text_completion(data: Any, where: str, model: str, latency_s: float) -> Completion:
    """A reply's text as a `Completion` without token ids or log-probs (`OpenAIEngineClient(text_only=True)`)."""
    try:
        choice = data["choices"][0]
        text = (choice.get("message") or {}).get("content")
    except (KeyError, IndexError, TypeError, AttributeError) as e:
        raise MalformedResponseError(f"{where}: response has no choices[0] ({e!r}); got {str(data)[:300]}",
                                     body=data) from e
    if not isinstance(text, str):
        raise MalformedResponseError(f"{where}: choices[0].message.content is not text; got {str(data)[:300]}",
                                     body=data)
    return Completion(text=text, prompt_token_ids=[], completion_token_ids=[], logprobs=[],
                      finish_reason=choice.get("finish_reason") or "stop", model=str(data.get("model") or model),
                      latency_s=latency_s)


def _error_reason(response: httpx.Response) -> tuple[str, Any]:
    """The server's own words: vLLM/OpenAI `{"error": {"message"}}`, FastAPI `{"detail"}`, or raw text."""
    try:
        body = response.json()
    except ValueError:
        return (response.text.strip() or response.reason_phrase), response.text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"]), body
        if isinstance(err, str):
            return err, body
        if "detail" in body:
            detail = body["detail"]
            return (detail if isinstance(detail, str) else str(detail)), body
        if body.get("message"):
            return str(body["message"]), body
    return str(body), body


def _context_error(reason: str, request: ChatRequest | None, where: str) -> ContextLengthError | None:
    """A `ContextLengthError` if the server's 400 says the prompt does not fit, else None."""
    for pattern in _CTX_PATTERNS:
        m = pattern.search(reason)
        if m:
            nums = [int(g) for g in m.groups()]
            max_context, prompt_tokens = nums[0], nums[1]
            asked = nums[2] if len(nums) > 2 else (request.max_tokens if request else 0)
            err = ContextLengthError(prompt_tokens, asked, max_context, request.agent if request else None)
            err.args = (f"{err.args[0]} (server said: {reason}; {where})",)
            return err
    return None


def _model_label(model: str) -> tuple[str | None, str | None]:
    """`"role@v3"` -> ("role", "v3"); any other name -> (name, None)."""
    if "@" in model:
        role, version = model.rsplit("@", 1)
        return role, version
    return model, None


class _StreamedReply:
    """The chunks of a streamed chat completion (server-sent events) put back together as its JSON body."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict[str, Any]] = []
        self.top: dict[str, Any] = {}
        self.finish_reason: str | None = None
        self.stop_reason: Any = None

    def add(self, line: str, where: str) -> tuple[list[int], list[float]]:
        """Take one SSE line; returns the token ids and log-probs it brought."""
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            return [], []
        try:
            chunk = json.loads(line[5:])
        except ValueError as e:
            raise MalformedResponseError(f"{where}: a stream chunk is not JSON ({e}): {line[:200]}") from None
        if isinstance(chunk.get("error"), dict):
            raise ServerRequestError(f"{where} failed while streaming: {chunk['error'].get('message')}",
                                     status_code=chunk["error"].get("code"), body=chunk)
        for key in ("id", "model", "usage", "marft", "prompt_token_ids"):
            if chunk.get(key) is not None:
                self.top[key] = chunk[key]
        ids: list[int] = []
        lps: list[float] = []
        for choice in chunk.get("choices") or []:
            self.content.append((choice.get("delta") or {}).get("content") or "")
            ids = [int(t) for t in choice.get("token_ids") or []]
            entries = (choice.get("logprobs") or {}).get("content") or []
            lps = [float(e["logprob"]) for e in entries]
            self.token_ids += ids
            self.logprobs += entries
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
            self.stop_reason = choice.get("stop_reason", self.stop_reason)
        return (ids, lps) if len(ids) == len(lps) else ([], [])

    def data(self) -> dict[str, Any]:
        """The non-streaming response body these chunks add up to."""
        choice = {"message": {"role": "assistant", "content": "".join(self.content)}, "token_ids": self.token_ids,
                  "logprobs": {"content": self.logprobs}, "finish_reason": self.finish_reason,
                  "stop_reason": self.stop_reason}
        return {**self.top, "choices": [choice]}


class OpenAIEngineClient:
    """Talk to an OpenAI-compatible engine (vLLM or `marft-lg serve`) at `base_url` (with or without /v1).

    `model` in every call is a served name: the base model's, an agent role, or an adapter ``role@vK``.
    Pass `transport` (e.g. `httpx.MockTransport`) to test without a server. `text_only`: ask for and return the
    reply's text only (no `logprobs` or `return_token_ids` in the request, the fields a strict hosted endpoint
    refuses): what a judge needs, never what the trainer needs.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = DEFAULT_TIMEOUT_S,
                 *, transport: httpx.BaseTransport | None = None,
                 async_transport: httpx.AsyncBaseTransport | None = None, text_only: bool = False):
        self.text_only = bool(text_only)
        url = base_url.rstrip("/")
        if url.endswith("/v1"):
            url = url[: -len("/v1")]
        self.base_url = url
        self.api_key = api_key
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._async_transport = async_transport
        self._http = httpx.Client(base_url=url, headers=self._headers, timeout=timeout, transport=transport)

    def __enter__(self) -> OpenAIEngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the pooled connections."""
        self._http.close()

    # ---- requests ---------------------------------------------------------------------------
    def payload(self, request: ChatRequest, model: str, extra_body: dict[str, Any] | None = None) -> dict[str, Any]:
        """The JSON body of a chat completion that returns token ids and sampled-token logprobs.

        `extra_body` adds engine-specific fields (e.g. vLLM's ``{"ignore_eos": true}`` for benchmarks).
        """
        body: dict[str, Any] = {
            "model": model,
            "messages": request.messages,
            "max_tokens": request.max_tokens,
            "temperature": request.temperature,
            "top_p": request.top_p,
        }
        if not self.text_only:
            body["logprobs"], body["return_token_ids"] = True, True
        if request.stop:
            body["stop"] = list(request.stop)
        if request.seed is not None:
            body["seed"] = request.seed
        if request.tools:  # rendered by the server's chat template; the completion is parsed by the caller
            body["tools"] = request.tools
            body["tool_choice"] = "none"
        body.update(vllm_fields(request.constraint))  # the server decodes under the grammar (vLLM's own fields)
        if extra_body:
            body.update(extra_body)
        return body

    def _to_completion(self, data: Any, request: ChatRequest, model: str, latency_s: float) -> Completion:
        where = f"POST {self.base_url}/v1/chat/completions model={model!r}"
        if self.text_only:
            return _text_completion(data, where, model, latency_s)
        try:
            choice = data["choices"][0]
            prompt_ids = data.get("prompt_token_ids")
            token_ids = choice.get("token_ids")
            content = (choice.get("logprobs") or {}).get("content")
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise MalformedResponseError(f"{where}: response has no choices[0] ({e!r}); got {str(data)[:300]}",
                                         body=data) from e
        missing = [name for name, v in (("prompt_token_ids", prompt_ids), ("choices[0].token_ids", token_ids),
                                        ("choices[0].logprobs.content", content)) if v is None]
        if missing:
            raise MalformedResponseError(
                f"{where}: response lacks {', '.join(missing)}; the server must support `return_token_ids` and "
                f"`logprobs` (vLLM >= 0.10.2 or `marft-lg serve`)", body=data)
        logprobs = [float(c["logprob"]) for c in content]
        if len(logprobs) != len(token_ids):
            raise MalformedResponseError(
                f"{where}: {len(token_ids)} completion token ids but {len(logprobs)} logprobs", body=data)
        message = choice.get("message") or {}
        role, version = _model_label(model)
        served = data.get("marft") if isinstance(data.get("marft"), dict) else {}  # `marft-lg serve` says which version answered
        if version is None:
            version = served.get("adapter_version") or request.version
        extra: dict[str, Any] = {}
        if data.get("id"):
            extra["id"] = data["id"]
        if served.get("logprobs_masked"):  # `marft-lg serve` masked them with the grammar; vLLM's are raw
            extra["logprobs_masked"] = True
        if choice.get("stop_reason") is not None:
            extra["stop_reason"] = choice["stop_reason"]
        if data.get("usage"):
            extra["usage"] = data["usage"]
        if message.get("tool_calls"):  # a server that parsed tool calls itself (its `content` lacks them)
            extra["tool_calls"] = message["tool_calls"]
        if message.get("invalid_tool_calls"):
            extra["invalid_tool_calls"] = message["invalid_tool_calls"]
        return Completion(
            text=message.get("content") or "",
            prompt_token_ids=[int(t) for t in prompt_ids],
            completion_token_ids=[int(t) for t in token_ids],
            logprobs=logprobs,
            finish_reason=choice.get("finish_reason") or "stop",
            agent=request.agent if request.agent is not None else (role if version else None),
            adapter_version=version,
            model=str(data.get("model") or model),
            latency_s=latency_s,
            extra=extra,
        )

    def _raise_for(self, response: httpx.Response, *, model: str | None = None,
                   request: ChatRequest | None = None, known: list[str] | None = None) -> None:
        if response.status_code < 400:
            return
        reason, body = _error_reason(response)
        where = f"{response.request.method} {response.request.url}"
        if response.status_code == 400:
            ctx = _context_error(reason, request, where)
            if ctx is not None:
                raise ctx
        if response.status_code == 404 and model is not None and known is not None and model not in known:
            raise UnknownAgentError(model, known, what="model")
        if response.status_code == 404:
            reason += f" (is {self.base_url} the server's address, without a path beyond /v1?)"
        if response.status_code == 401:
            reason += " (check the api_key given to OpenAIEngineClient)"
        raise ServerRequestError(f"{where} failed with HTTP {response.status_code}: {reason}",
                                 status_code=response.status_code, body=body)

    def _known_models(self) -> list[str] | None:
        """The served names, or None if the server cannot list them."""
        try:
            return self.models()
        except ServingError:
            return None

    def chat(self, request: ChatRequest, model: str, *, extra_body: dict[str, Any] | None = None) -> Completion:
        """One chat completion from `model`, with prompt/completion token ids, logprobs and latency."""
        t0 = time.perf_counter()
        try:
            response = self._http.post("/v1/chat/completions", json=self.payload(request, model, extra_body))
        except httpx.TransportError as e:
            raise self._unavailable(e) from e
        latency = time.perf_counter() - t0
        if response.status_code == 404:
            self._raise_for(response, model=model, request=request, known=self._known_models())
        self._raise_for(response, model=model, request=request)
        return self._to_completion(response.json(), request, model, latency)

    def _async_client(self) -> httpx.AsyncClient:
        # One AsyncClient per call: an AsyncClient is bound to the event loop that first used it.
        return httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self.timeout,
                                 transport=self._async_transport)

    async def _achat(self, http: httpx.AsyncClient, request: ChatRequest, model: str,
                     extra_body: dict[str, Any] | None = None, listener: TokenListener | None = None) -> Completion:
        t0 = time.perf_counter()
        if listener is not None:
            return await self._astream(http, request, model, extra_body, listener)
        try:
            response = await http.post("/v1/chat/completions", json=self.payload(request, model, extra_body))
        except httpx.TransportError as e:
            raise self._unavailable(e) from e
        latency = time.perf_counter() - t0
        await self._araise_for(http, response, model, request)
        return self._to_completion(response.json(), request, model, latency)

    async def _astream(self, http: httpx.AsyncClient, request: ChatRequest, model: str,
                       extra_body: dict[str, Any] | None, listener: TokenListener) -> Completion:
        """One streamed completion: `listener` hears each chunk's token ids and log-probs as the server sends them;
        the chunks are put together into the same `Completion` a non-streaming call returns."""
        t0 = time.perf_counter()
        body = {**self.payload(request, model, extra_body), "stream": True, "stream_options": {"include_usage": True}}
        whole = _StreamedReply()
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    await self._araise_for(http, response, model, request)
                async for line in response.aiter_lines():
                    ids, lps = whole.add(line, f"POST {self.base_url}/v1/chat/completions model={model!r}")
                    if ids:
                        listener(ids, lps)
        except httpx.TransportError as e:
            raise self._unavailable(e) from e
        return self._to_completion(whole.data(), request, model, time.perf_counter() - t0)

    async def _araise_for(self, http: httpx.AsyncClient, response: httpx.Response, model: str,
                          request: ChatRequest) -> None:
        if response.status_code == 404:
            known: list[str] | None = None
            try:
                listing = await http.get("/v1/models")
                if listing.status_code == 200:
                    known = [str(m["id"]) for m in listing.json()["data"]]
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                known = None
            self._raise_for(response, model=model, request=request, known=known)
        self._raise_for(response, model=model, request=request)

    async def achat(self, request: ChatRequest, model: str, *, extra_body: dict[str, Any] | None = None,
                    listener: TokenListener | None = None) -> Completion:
        """Async twin of `chat`; with `listener`, streamed (it hears the tokens as they come)."""
        async with self._async_client() as http:
            return await self._achat(http, request, model, extra_body, listener)

    async def achat_many(self, requests: Sequence[ChatRequest], models: Sequence[str], *,
                         max_concurrency: int = 64, extra_body: dict[str, Any] | None = None,
                         listeners: Sequence[TokenListener | None] | None = None) -> list[Completion]:
        """Send the requests concurrently (the server batches them); results in request order.

        At most `max_concurrency` are in flight. If any request fails, the others still run to
        completion and the first error is raised. `listeners[i]`: request i is streamed to it.
        """
        listeners = list(listeners) if listeners is not None else [None] * len(requests)
        if len(requests) != len(models):
            raise ValueError(f"achat_many: {len(requests)} requests but {len(models)} model names")
        width = max(1, min(len(requests), max_concurrency))
        sem = asyncio.Semaphore(width)
        limits = httpx.Limits(max_connections=width, max_keepalive_connections=width)
        async with httpx.AsyncClient(base_url=self.base_url, headers=self._headers, timeout=self.timeout,
                                     transport=self._async_transport, limits=limits) as http:

            async def one(request: ChatRequest, model: str, listener: TokenListener | None) -> Completion:
                async with sem:
                    return await self._achat(http, request, model, extra_body, listener)

            results = await asyncio.gather(*(one(r, m, li) for r, m, li in zip(requests, models, listeners, strict=True)),
                                           return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return list(results)  # type: ignore[arg-type]

    # ---- model and adapter management -------------------------------------------------------
    def _get(self, path: str) -> httpx.Response:
        try:
            return self._http.get(path)
        except httpx.TransportError as e:
            raise self._unavailable(e) from e

    def _post(self, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return self._http.post(path, json=body)
        except httpx.TransportError as e:
            raise self._unavailable(e) from e

    def model_cards(self) -> list[dict[str, Any]]:
        """`GET /v1/models` entries as the server sent them (vLLM adds `root`, `parent`, `max_model_len`)."""
        response = self._get("/v1/models")
        self._raise_for(response)
        try:
            return list(response.json()["data"])
        except (ValueError, KeyError, TypeError) as e:
            raise MalformedResponseError(f"GET {self.base_url}/v1/models: no `data` list in {response.text[:300]}",
                                         body=response.text) from e

    def models(self) -> list[str]:
        """Names the server answers to: the base model and every loaded adapter."""
        return [str(card["id"]) for card in self.model_cards()]

    def load_lora_adapter(self, name: str, path: str | Path, *, load_inplace: bool = False) -> None:
        """`POST /v1/load_lora_adapter`: serve the PEFT directory `path` as model `name`.

        `load_inplace=True` replaces the weights of an already loaded `name` (vLLM refuses otherwise).
        """
        body: dict[str, Any] = {"lora_name": name, "lora_path": str(path)}
        if load_inplace:
            body["load_inplace"] = True
        response = self._post("/v1/load_lora_adapter", body)
        if response.status_code >= 400:
            reason, payload = _error_reason(response)
            raise ServerRequestError(
                f"loading adapter {name!r} from {path} failed with HTTP {response.status_code}: {reason}",
                status_code=response.status_code, body=payload)

    def unload_lora_adapter(self, name: str) -> None:
        """`POST /v1/unload_lora_adapter`; an adapter the server does not know raises `UnknownAgentError`."""
        response = self._post("/v1/unload_lora_adapter", {"lora_name": name})
        if response.status_code == 404:
            known = self._known_models()
            if known is not None and name not in known:
                raise UnknownAgentError(name, known, what="adapter")
        self._raise_for(response)

    def health(self) -> bool:
        """True when `GET /health` answers 200; False when nothing answers or it is unhealthy."""
        try:
            return self._http.get("/health", timeout=min(self.timeout, 5.0)).status_code == 200
        except (httpx.HTTPError, RuntimeError):  # RuntimeError: this client was closed
            return False

    def _unavailable(self, e: Exception) -> ServerUnavailableError:
        return ServerUnavailableError(
            f"no answer from {self.base_url} ({type(e).__name__}: {e}); is the server running? "
            f"(start it with `marft-lg serve` or let VLLMEngine start vLLM)")
