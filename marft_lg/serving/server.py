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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from marft_lg.serving.chat_api import (
    TOOL_FORMATS,
    completion_response,
    known_models,
    parse_chat_body,
    stream_chunks,
)
from marft_lg.serving.errors import (
    AdapterIntegrityError,
    AdapterMismatchError,
    ContextLengthError,
    RegistryError,
    UnknownAgentError,
)
from marft_lg.serving.http import (
    DEFAULT_MAX_BODY_BYTES,
    BadRequest,
    RequestGuard,
    error_body,
    error_response,
    log,
    parse_json_body,
)
from marft_lg.serving.served_spans import CallContext, ServedRecorder
from marft_lg.serving.team import FRESH, SHARED
from marft_lg.serving.types import ServedTeam

_LOAD_USAGE = ('body must be {"lora_name": str, "lora_path": "<registry>/<role>/v<k>"} or '
               '{"lora_name": str, "version": "init"}')


def create_app(team: ServedTeam, *, api_key: str | None = None, tool_format: str = "auto",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, recorder: ServedRecorder | None = None) -> FastAPI:
    """The FastAPI app serving `team` (a `Team`, or a `MixedTeam` of several base models). With `api_key`,
    every path but /health (/docs, /redoc, /openapi.json too) needs ``Authorization: Bearer <key>``. `recorder`:
    every answered chat request is recorded as server spans (`served_spans`), joined to the caller's span through
    its W3C trace context.

    `tool_format`: how requests with ``tools`` are rendered: "auto" (the chat template when it renders
    tools, else the text format), "template" or "text" (`marft_lg.tool_calls`).
    `max_body_bytes`: larger request bodies get 413 without being read.
    """
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    if int(max_body_bytes) < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes!r}")
    app = FastAPI(title="marft_lg serving", version="0.1.0")
    app.state.team = team

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and wrong methods answer in the OpenAI error shape too, not FastAPI's ``detail``."""
        return JSONResponse(status_code=exc.status_code, headers=getattr(exc, "headers", None),
                            content=error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    _health_routes(app)
    _chat_routes(app, team, tool_format, recorder)
    _adapter_routes(app, team)
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)  # added last: the outermost layer
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
    raise e


def _health_routes(app: FastAPI) -> None:
    @app.get("/health")
    async def health():
        return {"status": "ok"}


def _chat_routes(app: FastAPI, team: ServedTeam, tool_format: str, recorder: ServedRecorder | None) -> None:
    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        start_ns = time.time_ns()
        context = CallContext.from_headers(request.headers)
        try:
            body = await _json(request)
            reqs, opts = parse_chat_body(body, team, tool_format, context)
            # a role goes through the team (which routes it to its base); a base model name to that base
            completions = await (team.achat(reqs) if opts["agent"] is not None else team.bases[opts["base"]].achat(reqs))
        except Exception as e:  # noqa: BLE001 - mapped to HTTP errors, anything else re-raised
            return _handle(e, registry_status=404, adapter_param="model")
        response = completion_response(team, completions, opts)
        if recorder is not None:
            try:
                recorder.record(context, body["messages"], opts, reqs, completions, response["id"], start_ns)
            except Exception:  # noqa: BLE001 - a record that cannot be made never fails the answer
                log.exception("request %s: recording the served completion failed", request.state.request_id)
        if opts["stream"]:
            return StreamingResponse(stream_chunks(team, response), media_type="text/event-stream")
        return response


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
        path_slot, version = team.registry.locate(path)
        if path_slot != slot:
            raise BadRequest(f"lora_path {path} holds adapters of {path_slot!r}, not of {role!r}", "lora_path")
        if pinned and pinned != version:
            raise BadRequest(f"lora_name {name!r} does not match the version at lora_path ({version})", "lora_name")
    if pinned:
        await asyncio.to_thread(team.adapter_name, role, version)
    else:
        await asyncio.to_thread(team.load_version, role, version)
    return name, version
