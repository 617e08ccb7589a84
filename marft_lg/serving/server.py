"""OpenAI-compatible HTTP server over a `Team`, with the endpoints and fields vLLM uses.

`model` is a role (its current adapter), ``role@version`` (a pinned version) or a base model
name (adapters off). A team of several base models (`MixedTeam`) is served the same way: each role's
requests go to its base, a base's name answers from that base without an adapter, `/v1/models` lists
every base and every role (its `root`/`parent` the role's base), and everything that depends on the
tokenizer (tool format detection, log-prob tokens) uses the role's base's (`team.tokenizer_for`).

`return_token_ids` adds `prompt_token_ids` to the response and `token_ids` to each choice, as vLLM
does, so the same client code reads both servers. `return_tokens_as_token_ids` (with `logprobs`) writes
each log-prob entry's token as ``token_id:{id}``, also as vLLM does: a client that keeps only the OpenAI
fields (a plain LangChain `ChatOpenAI`) still carries the exact completion token ids to the trace.

Tools: `tools`, `tool_choice` and `parallel_tool_calls` are honoured as OpenAI/vLLM do. The prompt
shows the tools through the model's chat template when it renders tools, else in the text format of
`marft_lg.tool_calls` (the one `TeamChatModel` uses); the completion's ``<tool_call>``
blocks come back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``, malformed ones stay
in ``content`` and are listed in ``message.invalid_tool_calls``.

Bad input never takes the server down: bodies over `max_body_bytes` get 413 before they are read
(or as soon as a chunked body passes the limit), JSON is parsed strictly (orjson: no lone
surrogates, no invalid UTF-8) and refused past `MAX_JSON_DEPTH` levels, a prompt longer than the
context can hold is refused from its length in characters before it is tokenized (off the event
loop), and any unexpected exception is a JSON 500 carrying a request id (also the ``x-request-id``
header of every response) whose traceback is in the log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import time
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from marft_lg.serving.errors import (
    AdapterIntegrityError,
    AdapterMismatchError,
    ContextLengthError,
    RegistryError,
    UnknownAgentError,
)
from marft_lg.serving.served_spans import CallContext, ServedRecorder
from marft_lg.serving.team import FRESH, SHARED
from marft_lg.serving.types import ChatRequest, Completion, ServedTeam
from marft_lg.tool_calls import (
    add_system_text,
    choice_name,
    openai_invalid_tool_calls,
    openai_tool_calls,
    parse_completion,
    render_messages,
    template_messages,
    template_supports_tools,
    tool_choice_instruction,
    tool_names,
    tools_active,
)

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 413: "PayloadTooLargeError",
                500: "InternalServerError"}
TOOL_FORMATS = ("auto", "template", "text")
DEFAULT_MAX_BODY_BYTES = 8 * 2**20
MAX_JSON_DEPTH = 64
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
log = logging.getLogger(__name__)


def _error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=_error_body(status, message, param))


class _BodyTooLarge(Exception):
    """Raised from `receive` when a (chunked) body passes the limit."""


class RequestGuard:
    """Pure ASGI middleware around the whole app: request ids, the API key of /v1/*, the body-size
    limit, and the last-resort handler that turns any unexpected exception into a logged JSON 500.

    Bodies are checked before anything reads them: a Content-Length over the limit is answered 413
    at once (the body is never read), and a chunked body is counted as it streams in and cut off with
    413 when it passes the limit, so an oversized request costs no memory.
    """

    def __init__(self, app: Any, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, api_key: str | None = None):
        self.app = app
        self.max_body_bytes = int(max_body_bytes)
        self.api_key = api_key

    async def _send_json(self, send: Any, status: int, body: dict[str, Any], rid: str) -> None:
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
            (b"x-request-id", rid.encode())] + ([(b"connection", b"close")] if status == 413 else [])})
        await send({"type": "http.response.body", "body": payload})

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        given = headers.get("x-request-id", "")
        rid = given if _REQUEST_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        if self.api_key and scope.get("path", "").startswith("/v1/"):
            given = headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                await self._send_json(send, 401, _error_body(
                    401, "missing or wrong API key: send 'Authorization: Bearer <key>'"), rid)
                return
        limit = self.max_body_bytes
        too_large = _error_body(413, f"request body larger than the server's limit of {limit} bytes "
                                     f"({limit / 2**20:.3g} MB; marft-lg serve --max-body-mb)")
        length = headers.get("content-length")
        if length is not None:
            if not length.strip().isdigit():
                await self._send_json(send, 400, _error_body(400, f"invalid Content-Length {length[:40]!r}"), rid)
                return
            if int(length) > limit:
                await self._send_json(send, 413, too_large, rid)
                return
        started = False
        received = 0

        async def guarded_receive() -> Any:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _BodyTooLarge
            return message

        async def tagged_send(message: Any) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, guarded_receive, tagged_send)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException as e:  # noqa: BLE001 - the last resort: logged with its traceback, answered as JSON
            too_big = isinstance(e, _BodyTooLarge) or (  # a task group below may re-raise ours wrapped
                isinstance(e, BaseExceptionGroup) and e.split(_BodyTooLarge)[1] is None)
            if too_big:
                if not started:
                    await self._send_json(send, 413, too_large, rid)
                return
            log.error("request %s %s %s failed", rid, scope.get("method"), scope.get("path"), exc_info=e)
            if not started:
                body = _error_body(500, f"internal server error ({type(e).__name__}); request id {rid}, whose "
                                        "traceback is in the server log")
                body["request_id"] = rid
                await self._send_json(send, 500, body, rid)


def _json_depth_exceeds(obj: Any, limit: int) -> bool:
    """True if `obj` nests objects/arrays deeper than `limit` (iterative: no recursion on hostile input)."""
    stack = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, dict):
            items = o.values()
        elif isinstance(o, list):
            items = o
        else:
            continue
        if depth > limit:
            return True
        stack.extend((v, depth + 1) for v in items)
    return False


def parse_json_body(raw: bytes) -> Any:
    """Strict JSON (orjson: invalid UTF-8 and lone surrogates are errors) nested at most `MAX_JSON_DEPTH` deep."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise _BadRequest(f"the request body is not valid JSON: {e}") from None
    if _json_depth_exceeds(body, MAX_JSON_DEPTH):
        raise _BadRequest(f"the request body nests JSON deeper than {MAX_JSON_DEPTH} levels")
    return body


class _BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise _BadRequest(f"{name} must be a number, got {value!r}", name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise _BadRequest(f"{name} must be {names}, got {type(value).__name__}", name)
    return value


def _parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise _BadRequest("tools must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                              f"\"description\": str, \"parameters\": JSON schema}}}}, got {tool!r:.200}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out.append({"type": "function", "function": fn})
    return out or None


def _parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise _BadRequest("tool_choice 'required' needs tools", "tool_choice")
        return choice
    name = choice_name(choice) if isinstance(choice, dict) else None
    if name is None:
        raise _BadRequest("tool_choice must be 'auto', 'none', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": str}}", "tool_choice")
    if name not in tool_names(tools):
        raise _BadRequest(f"tool_choice names {name!r}, which is not in tools ({tool_names(tools)})", "tool_choice")
    return {"type": "function", "function": {"name": name}}


def tokenizer_of(team: ServedTeam, agent: str | None, base: str | None = None) -> Any:
    """The tokenizer that encodes a request for `agent` (its base's), or for base model `base` when the
    request has no agent (the first base when `base` is None or unknown)."""
    if agent is not None:
        return team.tokenizer_for(agent)
    bases = team.bases
    return bases[base].tokenizer if base in bases else next(iter(bases.values())).tokenizer


def prompt_messages(team: ServedTeam, messages: list[Any], tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None, tool_format: str = "auto", *,
                    tokenizer: Any = None) -> tuple[list[Any], list[dict] | None]:
    """(messages for the engine, tools for the chat template or None) of a request with tool traffic.

    Through the chat template (``apply_chat_template(tools=...)``) when `tool_format` is "template",
    or "auto" and the tokenizer's template renders tools; else in the text format of
    `marft_lg.tool_calls.render_messages`, exactly as `TeamChatModel` renders it. `tokenizer`: the one of
    the request's base model (default: the team's first base's).
    """
    active = tools_active(tools, tool_choice)
    tok = tokenizer if tokenizer is not None else tokenizer_of(team, None)
    if tool_format == "template" or (tool_format == "auto" and template_supports_tools(tok)):
        chat = template_messages(messages)
        line = tool_choice_instruction(tool_choice) if active else None
        if line:
            add_system_text(chat, line)
        return chat, (tools if active else None)
    return render_messages(messages, tools, tool_choice, parallel_tool_calls), None


def parse_chat_body(body: Any, team: ServedTeam, tool_format: str = "auto",
                    context: CallContext | None = None) -> tuple[list[ChatRequest], dict[str, Any]]:
    """A /v1/chat/completions JSON body -> one ChatRequest per choice, plus response options (``base``: the
    name of the base model that answers, ``agent``: the role, None for a base model name). `context`: the caller's
    baggage; its version pin and seed apply where the body names none (``model: role@version`` and ``seed`` win)."""
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' is required: an agent role, 'role@version', or the base model name", "model")
    agent, version, base = _parse_model(model, team)
    if version is None and context is not None:
        version = context.version_for(agent)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    max_tokens = _field(body, "max_completion_tokens", int, None) or _field(body, "max_tokens", int, 256)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _BadRequest("stop must be a string or a list of strings", "stop")
    n = _field(body, "n", int, 1)
    if not 1 <= n <= 16:
        raise _BadRequest(f"n must be in [1, 16], got {n}", "n")
    logprobs = bool(_field(body, "logprobs", bool, False))
    top_logprobs = _field(body, "top_logprobs", int, 0)
    if top_logprobs and not logprobs:
        raise _BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    seed = _field(body, "seed", int, None)
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1 - n:
        raise _BadRequest(f"seed must be a 64-bit integer, got {seed}", "seed")
    if seed is None and context is not None:
        seed = context.seed
    tools = _parse_tools(body)
    tool_choice = _parse_tool_choice(body, tools)
    parallel = bool(_field(body, "parallel_tool_calls", bool, True))
    chat, template_tools = prompt_messages(team, messages, tools, tool_choice, parallel, tool_format,
                                           tokenizer=tokenizer_of(team, agent, base))
    reqs = [
        ChatRequest(
            messages=chat, agent=agent, version=version, max_tokens=max_tokens, tools=template_tools,
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)), stop=stop or None,
            seed=None if seed is None else seed + i, top_logprobs=top_logprobs,
            ignore_eos=bool(_field(body, "ignore_eos", bool, False)),
        )
        for i in range(n)
    ]
    opts = {"model": model, "base": base, "agent": agent, "logprobs": logprobs, "return_token_ids": bool(_field(body, "return_token_ids", bool, False)),
            "tokens_as_ids": bool(_field(body, "return_tokens_as_token_ids", bool, False)),
            "stream": bool(_field(body, "stream", bool, False)),
            "tool_names": tool_names(tools) if tools_active(tools, tool_choice) else None,
            "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    return reqs, opts


def _parse_model(model: str, team: ServedTeam) -> tuple[str | None, str | None, str]:
    """A request's `model` -> (role or None, pinned version or None, the name of the base model that answers).
    A role wins over a base model of the same name (a base in a folder named after the role it serves)."""
    role, _, version = model.partition("@")
    if role in team.agents():
        return role, (version or None), team.base_of(role)
    if model in team.bases:
        return None, None, model
    raise UnknownAgentError(model, known_models(team), what="model")


def known_models(team: ServedTeam) -> list[str]:
    """Model ids the server answers to: every base model, the roles, and each loaded ``role@version``."""
    ids = [*team.bases, *team.agents()]
    for base in team.bases.values():
        roles = base.agents()
        for name in base.engine.loaded_adapters():
            slot, _, version = name.partition("@")
            ids.extend(f"{r}@{version}" for r in (roles if base.shared_adapter else [slot]) if r in roles)
    return list(dict.fromkeys(ids))


def _logprobs_block(tok: Any, c: Completion, tokens_as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice; `tokens_as_ids`: tokens as ``token_id:{id}`` (vLLM's
    `return_tokens_as_token_ids`)."""
    def token(i: int) -> str:
        return f"token_id:{i}" if tokens_as_ids else tok.decode([i])

    tops = c.extra.get("top_logprobs") or []
    content = []
    for k, (t, lp) in enumerate(zip(c.completion_token_ids, c.logprobs, strict=True)):
        text = token(t)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        if k < len(tops):
            entry["top_logprobs"] = [
                {"token": (s := token(i)), "logprob": v, "bytes": list(s.encode())} for i, v in tops[k].items()
            ]
        content.append(entry)
    return {"content": content}


def _message(c: Completion, opts: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The choice's message and finish_reason; with tools, the completion's tool calls parsed out of it."""
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if opts.get("tool_names") is None:
        return message, c.finish_reason
    parsed = parse_completion(c.text, opts["tool_names"], parallel_tool_calls=opts.get("parallel_tool_calls"))
    message["content"] = parsed.content
    finish_reason = c.finish_reason
    if parsed.tool_calls:
        message["tool_calls"] = openai_tool_calls(parsed.tool_calls)
        finish_reason = "tool_calls"
    if parsed.invalid_tool_calls:
        message["invalid_tool_calls"] = openai_invalid_tool_calls(parsed.invalid_tool_calls)
    return message, finish_reason


def completion_response(team: ServedTeam, completions: list[Completion], opts: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat.completion JSON (vLLM's extra fields when asked); log-prob tokens decoded by the tokenizer
    of the base model that answered."""
    choices = []
    tok = None
    if opts["logprobs"] and completions:
        tok = tokenizer_of(team, opts.get("agent", completions[0].agent), opts.get("base", completions[0].model))
    for i, c in enumerate(completions):
        message, finish_reason = _message(c, opts)
        choice: dict[str, Any] = {
            "index": i, "message": message,
            "logprobs": _logprobs_block(tok, c, opts.get("tokens_as_ids", False)) if opts["logprobs"] else None,
            "finish_reason": finish_reason, "stop_reason": None,
        }
        if opts["return_token_ids"]:
            choice["token_ids"] = c.completion_token_ids
        choices.append(choice)
    prompt = completions[0].prompt_token_ids
    out: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": opts["model"], "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c.completion_token_ids) for c in completions),
                  "total_tokens": len(prompt) + sum(len(c.completion_token_ids) for c in completions)},
        "marft": {"agent": completions[0].agent, "adapter_version": completions[0].adapter_version},
    }
    if opts["return_token_ids"]:
        out["prompt_token_ids"] = prompt
    return out


def _stream_chunks(team: ServedTeam, response: dict[str, Any]):
    """Server-sent events for a finished completion, then [DONE].

    Per choice: a role chunk, one content chunk (with logprobs and token ids), and when the
    completion called tools, two ``delta.tool_calls`` chunks per call (id, type and name, then the
    arguments, as OpenAI streams them) and a closing chunk with the finish_reason (and
    ``delta.invalid_tool_calls`` for malformed calls).
    """
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}

    def event(choice: dict[str, Any]) -> str:
        return f"data: {json.dumps({**base, 'choices': [choice]})}\n\n"

    for ch in response["choices"]:
        message, index = ch["message"], ch["index"]
        calls, invalid = message.get("tool_calls") or [], message.get("invalid_tool_calls") or []
        yield event({"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
        delta: dict[str, Any] = {"index": index, "delta": {"content": message["content"] or ""},
                                 "logprobs": ch["logprobs"],
                                 "finish_reason": None if calls or invalid else ch["finish_reason"]}
        if "token_ids" in ch:
            delta["token_ids"] = ch["token_ids"]
        yield event(delta)
        for k, call in enumerate(calls):
            head = {"index": k, "id": call["id"], "type": "function",
                    "function": {"name": call["function"]["name"], "arguments": ""}}
            yield event({"index": index, "delta": {"tool_calls": [head]}, "finish_reason": None})
            args = {"index": k, "function": {"arguments": call["function"]["arguments"]}}
            yield event({"index": index, "delta": {"tool_calls": [args]}, "finish_reason": None})
        if calls or invalid:
            yield event({"index": index, "delta": {"invalid_tool_calls": invalid} if invalid else {},
                         "finish_reason": ch["finish_reason"]})
    yield f"data: {json.dumps({**base, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def create_app(team: ServedTeam, *, api_key: str | None = None, tool_format: str = "auto",
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, recorder: ServedRecorder | None = None) -> FastAPI:
    """The FastAPI app serving `team` (a `Team`, or a `MixedTeam` of several base models). With `api_key`,
    /v1/* needs ``Authorization: Bearer <key>``. `recorder`: every answered chat request is recorded as server
    spans (`served_spans`), joined to the caller's span through its W3C trace context.

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
                            content=_error_body(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    async def _json(request: Request) -> Any:
        raw = await request.body()  # bounded by RequestGuard
        if len(raw) > 2**20:  # parsing megabytes takes milliseconds: keep them off the event loop
            return await asyncio.to_thread(parse_json_body, raw)
        return parse_json_body(raw)

    def _handle(e: Exception, registry_status: int = 400, adapter_param: str | None = None):
        if isinstance(e, _BadRequest):
            return _error(400, str(e), e.param)
        if isinstance(e, UnknownAgentError):
            return _error(404, str(e), "model")
        if isinstance(e, AdapterIntegrityError):
            return _error(400, str(e), adapter_param)
        if isinstance(e, RegistryError):
            return _error(registry_status, str(e), "model" if registry_status == 404 else None)
        if isinstance(e, (ContextLengthError, AdapterMismatchError, RegistryError, ValueError)):
            return _error(400, str(e))
        raise e

    @app.get("/health")
    async def health():
        return {"status": "ok"}

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
            is_base = mid in bases
            base = mid if is_base else team.base_of(mid.partition("@")[0])
            data.append({"id": mid, "object": "model", "created": created, "owned_by": "marft_lg",
                         "root": base, "parent": None if is_base else base,
                         "max_model_len": bases[base].engine.max_context()})
        return {"object": "list", "data": data}

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
            return StreamingResponse(_stream_chunks(team, response), media_type="text/event-stream")
        return response

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        """vLLM's call: ``{"lora_name": role, "lora_path": <registry>/<role>/v<k>}`` hot-swaps the role;
        ``"role@v<k>"`` only loads the pinned version. marft extension: ``{"lora_name": role,
        "version": "init"}`` (no lora_path) serves the role's initial adapter again.

        The version's files are verified before the engine is touched: a damaged one is a 400 naming the
        file, and the role keeps serving what it served.
        """
        try:
            body = await _json(request)
            usage = ('body must be {"lora_name": str, "lora_path": "<registry>/<role>/v<k>"} or '
                     '{"lora_name": str, "version": "init"}')
            if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) or not body["lora_name"]:
                raise _BadRequest(usage, "lora_name")
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
                    raise _BadRequest(usage, "lora_path")
                version = FRESH
            else:
                if not isinstance(path, str):
                    raise _BadRequest(usage, "lora_path")
                if team.registry is None:
                    raise _BadRequest("this server has no adapter registry (start it with --registry DIR)")
                path_slot, version = team.registry.locate(path)
                if path_slot != slot:
                    raise _BadRequest(f"lora_path {path} holds adapters of {path_slot!r}, not of {role!r}", "lora_path")
                if pinned and pinned != version:
                    raise _BadRequest(f"lora_name {name!r} does not match the version at lora_path ({version})",
                                      "lora_name")
            if pinned:
                await asyncio.to_thread(team.adapter_name, role, version)
            else:
                await asyncio.to_thread(team.load_version, role, version)
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
                raise _BadRequest("body must be {\"lora_name\": \"role@version\"}")
            role, _, version = name.partition("@")
            if not version:
                raise _BadRequest(f"{name!r} is a role: a role always serves one adapter; unload a 'role@version'")
            await asyncio.to_thread(team.unload_version, role, version)
        except Exception as e:  # noqa: BLE001
            return _handle(e)
        return {"status": "ok", "lora_name": name}

    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes, api_key=api_key)  # added last: the outermost layer
    return app
