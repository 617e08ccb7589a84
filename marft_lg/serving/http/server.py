"""OpenAI-compatible HTTP server over a `Team`, with the endpoints and fields vLLM uses (`marft-lg serve`).

`create_app` assembles three groups of routes over one team: health, chat (`/v1/chat/completions`, whose wire
format is `chat_api`), and adapters (`/v1/models`, `/v1/adapters`, vLLM's `/v1/load_lora_adapter` and
`/v1/unload_lora_adapter`). A team of several base models (`MixedTeam`) is served the same way: each role's
requests go to its base, a base's name answers from that base without an adapter, `/v1/models` lists every base
and every role. Everything about bad input (body limit, strict JSON, request ids, the API key, the error shape,
the last-resort JSON 500) is `http.RequestGuard`'s; every answered chat request may be recorded as server spans
(`served_spans`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from marft_lg.serving.engine.streaming import queue_listener, streams
from marft_lg.serving.errors import (
    AdapterIntegrityError,
    AdapterMismatchError,
    ContextLengthError,
    RegistryError,
    UnknownAgentError,
)
from marft_lg.serving.http.chat_api import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    TOOL_FORMATS,
    completion_response,
    encoded_response,
    known_models,
    parse_chat_body,
)
from marft_lg.serving.http.chat_stream import ChunkStream
from marft_lg.serving.http.served_spans import CallContext, ServedRecorder
from marft_lg.serving.http.transport import (
    DEFAULT_MAX_BODY_BYTES,
    BadRequest,
    RequestGuard,
    error_body,
    error_response,
    log,
    parse_json_body,
)
from marft_lg.serving.team import FRESH, SHARED
from marft_lg.serving.types import ServedTeam
from marft_lg.tracing import attributes as A
from marft_lg.tracing.feedback import parse_feedback, write_feedback

_LOAD_USAGE = ('body must be {"lora_name": str, "lora_path": "<registry>/<role>/v<k>"} or '
               '{"lora_name": str, "version": "init"}')


DEFAULT_REQUEST_TIMEOUT_S = 600.0
DEFAULT_READ_TIMEOUT_S = 30.0


def create_app(team: ServedTeam, *, api_key: str | None = None, tool_format: str = "auto",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, recorder: ServedRecorder | None = None,
               request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               read_timeout_s: float = DEFAULT_READ_TIMEOUT_S,
               engine_for: Callable[[CallContext], Any] | None = None,
               max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES,
               feedback_dir: str | Path | None = None) -> FastAPI:
    """The FastAPI app serving `team` (a `Team`, or a `MixedTeam` of several base models). With `api_key`,
    every path but /health (/docs, /redoc, /openapi.json too) needs ``Authorization: Bearer <key>``. `recorder`:
    every answered chat request is recorded as server spans (`served_spans`), joined to the caller's span through
    its W3C trace context.

    `tool_format`: how requests with ``tools`` are rendered: "auto" (the chat template when it renders
    tools, else the text format), "template" or "text" (`marft_lg.tool_calls`).
    `max_body_bytes`: larger request bodies get 413 without being read.
    `request_timeout_s`: a generation still running after this long is cancelled (504, or an error event when
    streaming). `read_timeout_s`: a client that has not sent its whole request by then gets 408, and a streaming
    client that reads nothing for this long is dropped. A client that hangs up cancels its generation at the next
    decode step, streaming or not. `engine_for(context)`: the engine that answers a role's calls of the caller's
    episode instead of the team, or None (the loopback server of a wrapped app: a counterfactual replay's engine).
    `max_logprob_entries`: a request whose answer could hold more log-prob entries (n x max_tokens x
    (top_logprobs + 1)) is a 400; answers are built and encoded off the event loop.
    `feedback_dir`: ``POST /v1/feedback`` (`tracing.feedback`: a user's verdict about an episode, by episode, thread
    or trace id) is written there as feedback spans, joined to its episode at mining; without it the route is a 404.
    """
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    if int(max_body_bytes) < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
    if not (request_timeout_s > 0 and read_timeout_s > 0):
        raise ValueError(f"timeouts must be > 0 s, got request {request_timeout_s!r}, read {read_timeout_s!r}")
    app = FastAPI(title="marft_lg serving", version="0.1.0")
    app.state.team = team

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and wrong methods answer in the OpenAI error shape too, not FastAPI's ``detail``."""
        return JSONResponse(status_code=exc.status_code, headers=getattr(exc, "headers", None),
                            content=error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    _health_routes(app)
    _chat_routes(app, team, tool_format, recorder, float(request_timeout_s), engine_for, int(max_logprob_entries))
    _adapter_routes(app, team)
    _feedback_routes(app, feedback_dir)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key, read_timeout_s=read_timeout_s)  # added last: the outermost layer
    return app


async def _json(request: Request) -> Any:
    raw = await request.body()  # bounded by RequestGuard
    if len(raw) > 2**20:  # parsing megabytes takes milliseconds: keep them off the event loop
        return await asyncio.to_thread(parse_json_body, raw)
    return parse_json_body(raw)


def _handle(e: Exception, registry_status: int = 400, adapter_param: str | None = None) -> JSONResponse:
    """A request's failure as its HTTP answer (4xx); anything unexpected is re-raised for `RequestGuard`'s 500."""
    if isinstance(e, BadRequest):
        return error_response(400, str(e), e.param)
    if isinstance(e, UnknownAgentError):
        return error_response(404, str(e), "model")
    if isinstance(e, AdapterIntegrityError):
        return error_response(400, str(e), adapter_param)
    if isinstance(e, RegistryError):
        return error_response(registry_status, str(e), "model" if registry_status == 404 else None)
    if isinstance(e, (ContextLengthError, AdapterMismatchError, ValueError)):
        return error_response(400, str(e))
    if isinstance(e, TimeoutError):
        return error_response(504, str(e))
    raise e


def _health_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}


def _chat_routes(app: FastAPI, team: ServedTeam, tool_format: str, recorder: ServedRecorder | None,
                 timeout_s: float, engine_for: Callable[[CallContext], Any] | None = None,
                 max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        start_ns = time.time_ns()
        context = CallContext.from_headers(request.headers)
        try:
            body = await _json(request)
            reqs, opts = parse_chat_body(body, team, tool_format, context, max_logprob_entries)
        except Exception as e:  # noqa: BLE001 - mapped to HTTP errors, anything else re-raised
            return _handle(e, registry_status=404, adapter_param="model")
        served = team if opts["agent"] is not None else team.bases[opts["base"]]  # a role via the team, a base name to it
        if engine_for is not None and opts["agent"] is not None:
            served = engine_for(context) or served
        call = _Call(request, served, reqs, opts, timeout_s)

        def record(response: dict[str, Any], completions: list[Any]) -> None:
            if recorder is None:
                return
            try:
                recorder.record(context, body["messages"], opts, reqs, completions, response["id"], start_ns)
            except Exception:  # noqa: BLE001 - a record that cannot be made never fails the answer
                log.exception("request %s: recording the served completion failed", request.state.request_id)

        if opts["stream"]:
            return await call.stream(record)
        try:
            completions = await call.whole()
        except _ClientGone:
            return error_response(499, "the client closed the connection before its answer was ready")
        except Exception as e:  # noqa: BLE001
            return _handle(e, registry_status=404, adapter_param="model")
        response, raw = await asyncio.to_thread(encoded_response, team, completions, opts)
        record(response, completions)
        return Response(raw, media_type="application/json")


class _ClientGone(Exception):
    """The client hung up before its answer was ready."""


class _Call:
    """One chat request being generated: it is cancelled when its client hangs up or it outlives `timeout_s`."""

    def __init__(self, request: Request, served: Any, reqs: list[Any], opts: dict[str, Any], timeout_s: float):
        self.request, self.served, self.reqs, self.opts, self.timeout_s = request, served, reqs, opts, timeout_s
        self.deadline = time.monotonic() + timeout_s

    async def _hung_up(self) -> None:
        while (await self.request.receive())["type"] != "http.disconnect":
            pass

    async def _race(self, task: asyncio.Future, *others: asyncio.Future, watch: bool = True) -> set[asyncio.Future]:
        """Wait for `task` or one of `others`, the client's hang-up (unless `watch` is off: a streaming response hears
        it itself) or the deadline; the task is cancelled on the last two."""
        hung_up = asyncio.ensure_future(self._hung_up()) if watch else asyncio.get_running_loop().create_future()
        try:
            done, _ = await asyncio.wait({task, hung_up, *others}, timeout=max(0.0, self.deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            hung_up.cancel()
        if task in done or any(o in done for o in others):
            return done
        task.cancel()
        if hung_up in done:
            log.info("request %s: the client hung up; its generation is cancelled", self.request.state.request_id)
            raise _ClientGone
        raise TimeoutError(f"the generation took longer than the server's request timeout ({self.timeout_s:g} s; "
                           "marft-lg serve --request-timeout)")

    async def whole(self) -> list[Any]:
        """The completions; `_ClientGone` when the client hangs up first (its rows are cancelled)."""
        task = asyncio.ensure_future(self.served.achat(self.reqs))
        await self._race(task)
        return task.result()

    async def stream(self, record: Any) -> Any:
        """A `StreamingResponse` whose chunks follow the decoding; a request refused before its first token is
        still answered with its 4xx."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        listeners = [queue_listener(loop, queue, i) for i in range(len(self.reqs))]
        # a team that cannot stream answers whole: its text comes with the last chunk
        call = self.served.achat(self.reqs, listeners) if streams(self.served.achat) else self.served.achat(self.reqs)
        task = asyncio.ensure_future(call)
        first = asyncio.ensure_future(queue.get())
        try:
            await self._race(task, first)
        except (_ClientGone, TimeoutError) as e:
            first.cancel()
            return error_response(*((504, str(e)) if isinstance(e, TimeoutError) else (499, "client gone")))
        got = [first.result()] if first.done() else []
        if not first.done():
            first.cancel()
            if task.exception() is not None:
                return _handle(task.exception(), registry_status=404, adapter_param="model")
        return StreamingResponse(self._events(task, queue, got, record), media_type="text/event-stream")

    async def _events(self, task: asyncio.Future, queue: asyncio.Queue, got: list[Any], record: Any) -> Any:
        """The stream's events: tokens as the queue brings them (`got`: those already taken), then the end."""
        chunks = ChunkStream(self.served, self.reqs, self.opts)
        try:
            for event in chunks.start():
                yield event
            while True:
                while not queue.empty():
                    got.append(queue.get_nowait())
                for index, ids, lps in got:
                    if (event := chunks.tokens(index, ids, lps)) is not None:
                        yield event
                got = []
                if task.done():
                    break
                nxt = asyncio.ensure_future(queue.get())
                # Starlette's StreamingResponse listens for the disconnect and cancels this generator itself
                if nxt in await self._race(task, nxt, watch=False):
                    got.append(nxt.result())
                else:
                    nxt.cancel()
            completions = task.result()
            response = await asyncio.to_thread(completion_response, self.served, completions, self.opts, chunks.id)
            record(response, completions)
            for event in chunks.finish(response):
                yield event
        except _ClientGone:
            return
        except Exception as e:  # noqa: BLE001 - the status line is sent: the failure becomes the last event
            status = 504 if isinstance(e, TimeoutError) else 500
            if status == 500:
                log.exception("request %s: the stream failed", self.request.state.request_id)
            for event in chunks.error(status, str(e) or type(e).__name__):
                yield event
        finally:
            if not task.done():
                task.cancel()


def _feedback_routes(app: FastAPI, feedback_dir: str | Path | None) -> None:
    @app.post("/v1/feedback")
    async def feedback(request: Request):
        """A product posts what its user said about an episode: ``{"thread_id" | "episode_id" | "trace_id", "turn"?,
        "name", "value", "comment"?, "metadata"?}``; written as a feedback span (joined to its episode at mining)."""
        if feedback_dir is None:
            return error_response(404, "this server records no feedback (started with --no-trace)")
        try:
            attrs = parse_feedback(await _json(request), "feedback")
            await asyncio.to_thread(write_feedback, attrs, feedback_dir)
        except ValueError as e:
            return error_response(400, str(e))
        target = next((k, attrs[a]) for k, a in (("episode_id", A.MARFT_EPISODE_ID),
                                                 ("thread_id", A.MARFT_FEEDBACK_THREAD_ID),
                                                 ("trace_id", A.MARFT_FEEDBACK_TRACE_ID)) if a in attrs)
        return {"object": "marft.feedback", "status": "recorded", target[0]: target[1],
                "name": attrs[A.MARFT_FEEDBACK_NAME]}


def _adapter_routes(app: FastAPI, team: ServedTeam) -> None:
    @app.get("/v1/adapters")
    async def adapters():
        """What this server serves now: each role's version, each adapter slot's (what an alias maps),
        and the registry alias it was started from."""
        return {"object": "marft.adapters", "versions": team.versions(), "adapters": team.slot_versions(),
                "follows": team.follows, "registry": None if team.registry is None else str(team.registry.root)}

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = []
        bases = team.bases
        for mid in known_models(team):
            is_base = mid in bases and mid.partition("@")[0] not in team.agents()
            base = mid if is_base else team.base_of(mid.partition("@")[0])
            data.append({"id": mid, "object": "model", "created": created, "owned_by": "marft_lg",
                         "root": base, "parent": None if is_base else base,
                         "max_model_len": bases[base].engine.max_context()})
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """vLLM's call: ``{"lora_name": role, "lora_path": <registry>/<role>/v<k>}`` hot-swaps the role;
        ``"role@v<k>"`` only loads the pinned version. marft extension: ``{"lora_name": role,
        "version": "init"}`` (no lora_path) serves the role's initial adapter again.

        The version's files are verified before the engine is touched: a damaged one is a 400 naming the
        file, and the role keeps serving what it served.
        """
        try:
            name, version = await _load(team, await _json(request))
        except Exception as e:  # noqa: BLE001
            return _handle(e, adapter_param="lora_path")
        return {"status": "ok", "lora_name": name, "version": version, "versions": team.versions(),
                "adapters": team.slot_versions()}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        try:
            body = await _json(request)
            name = body.get("lora_name") if isinstance(body, dict) else None
            if not isinstance(name, str):
                raise BadRequest("body must be {\"lora_name\": \"role@version\"}")
            role, _, version = name.partition("@")
            if not version:
                raise BadRequest(f"{name!r} is a role: a role always serves one adapter; unload a 'role@version'")
            await asyncio.to_thread(team.unload_version, role, version)
        except Exception as e:  # noqa: BLE001
            return _handle(e)
        return {"status": "ok", "lora_name": name}


async def _load(team: ServedTeam, body: Any) -> tuple[str, str]:
    """`/v1/load_lora_adapter`'s body checked and carried out: (lora_name, the version now loaded)."""
    if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
        raise BadRequest(_LOAD_USAGE, "lora_name")
    name = body["lora_name"]
    role, _, pinned = name.partition("@")
    if team.shared_adapter and role == SHARED:
        role = team.agents()[0]
    if role not in team.agents():
        raise UnknownAgentError(name, team.agents(), what="agent")
    slot = team.slot(role)
    path = body.get("lora_path")
    if path is None:
        if body.get("version") != FRESH or pinned:
            raise BadRequest(_LOAD_USAGE, "lora_path")
        version = FRESH
    else:
        if not isinstance(path, str):
            raise BadRequest(_LOAD_USAGE, "lora_path")
        if team.registry is None:
            raise BadRequest("this server has no adapter registry (start it with --registry DIR)")
        if "\x00" in path:
            raise BadRequest("lora_path contains a NUL character; give <registry>/<role>/v<k>", "lora_path")
        try:
            path_slot, version = team.registry.locate(path)
        except (RegistryError, ValueError, OSError) as e:
            raise BadRequest(str(e), "lora_path") from None
        if path_slot != slot:
            raise BadRequest(f"lora_path {path} holds adapters of {path_slot!r}, not of {role!r}", "lora_path")
        if pinned and pinned != version:
            raise BadRequest(f"lora_name {name!r} does not match the version at lora_path ({version})", "lora_name")
    if pinned:
        await asyncio.to_thread(team.adapter_name, role, version)
    else:
        await asyncio.to_thread(team.load_version, role, version)
    return name, version
