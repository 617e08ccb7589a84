"""OpenAI-compatible HTTP server over a `Team`, with the endpoints and fields vLLM uses.

`model` is a role (its current adapter), ``role@version`` (a pinned version) or the base model
name (adapters off). `return_token_ids` adds `prompt_token_ids` to the response and `token_ids` to
each choice, as vLLM does, so the same client code reads both servers.

Tools: `tools`, `tool_choice` and `parallel_tool_calls` are honoured as OpenAI/vLLM do. The prompt
shows the tools through the model's chat template when it renders tools, else in the text format of
`marft_lg.serving.tool_calls` (the one `TeamChatModel` uses); the completion's ``<tool_call>``
blocks come back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``, malformed ones stay
in ``content`` and are listed in ``message.invalid_tool_calls``.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from marft_lg.serving.errors import AdapterMismatchError, ContextLengthError, RegistryError, UnknownAgentError
from marft_lg.serving.team import Team
from marft_lg.serving.tool_calls import (
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
from marft_lg.serving.types import ChatRequest, Completion

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError"}
TOOL_FORMATS = ("auto", "template", "text")


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {
        "message": message, "type": _ERROR_TYPES.get(status, "Error"), "param": param, "code": status}})


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


def prompt_messages(team: Team, messages: list[Any], tools: list[dict[str, Any]] | None, tool_choice: Any,
                    parallel_tool_calls: bool | None, tool_format: str = "auto") -> tuple[list[Any], list[dict] | None]:
    """(messages for the engine, tools for the chat template or None) of a request with tool traffic.

    Through the chat template (``apply_chat_template(tools=...)``) when `tool_format` is "template",
    or "auto" and the tokenizer's template renders tools; else in the text format of
    `marft_lg.serving.tool_calls.render_messages`, exactly as `TeamChatModel` renders it.
    """
    active = tools_active(tools, tool_choice)
    if tool_format == "template" or (tool_format == "auto" and template_supports_tools(team.tokenizer)):
        chat = template_messages(messages)
        line = tool_choice_instruction(tool_choice) if active else None
        if line:
            add_system_text(chat, line)
        return chat, (tools if active else None)
    return render_messages(messages, tools, tool_choice, parallel_tool_calls), None


def parse_chat_body(body: Any, team: Team, tool_format: str = "auto") -> tuple[list[ChatRequest], dict[str, Any]]:
    """A /v1/chat/completions JSON body -> one ChatRequest per choice, plus response options."""
    if not isinstance(body, dict):
        raise _BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _BadRequest("'model' is required: an agent role, 'role@version', or the base model name", "model")
    agent, version = _parse_model(model, team)
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
    tools = _parse_tools(body)
    tool_choice = _parse_tool_choice(body, tools)
    parallel = bool(_field(body, "parallel_tool_calls", bool, True))
    chat, template_tools = prompt_messages(team, messages, tools, tool_choice, parallel, tool_format)
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
    opts = {"model": model, "logprobs": logprobs, "return_token_ids": bool(_field(body, "return_token_ids", bool, False)),
            "stream": bool(_field(body, "stream", bool, False)),
            "tool_names": tool_names(tools) if tools_active(tools, tool_choice) else None,
            "parallel_tool_calls": parallel}
    return reqs, opts


def _parse_model(model: str, team: Team) -> tuple[str | None, str | None]:
    if model == team.model_name:
        return None, None
    role, _, version = model.partition("@")
    if role not in team.agents():
        raise UnknownAgentError(model, known_models(team), what="model")
    return role, (version or None)


def known_models(team: Team) -> list[str]:
    """Model ids the server answers to: base model, roles, and each loaded ``role@version``."""
    ids = [team.model_name, *team.agents()]
    for name in team.engine.loaded_adapters():
        slot, _, version = name.partition("@")
        roles = team.agents() if team.shared_adapter else [slot]
        ids.extend(f"{r}@{version}" for r in roles if r in team.agents())
    return list(dict.fromkeys(ids))


def _logprobs_block(team: Team, c: Completion) -> dict[str, Any]:
    tok = team.tokenizer
    tops = c.extra.get("top_logprobs") or []
    content = []
    for k, (t, lp) in enumerate(zip(c.completion_token_ids, c.logprobs, strict=True)):
        text = tok.decode([t])
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        if k < len(tops):
            entry["top_logprobs"] = [
                {"token": (s := tok.decode([i])), "logprob": v, "bytes": list(s.encode())} for i, v in tops[k].items()
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


def completion_response(team: Team, completions: list[Completion], opts: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat.completion JSON (vLLM's extra fields when asked)."""
    choices = []
    for i, c in enumerate(completions):
        message, finish_reason = _message(c, opts)
        choice: dict[str, Any] = {
            "index": i, "message": message,
            "logprobs": _logprobs_block(team, c) if opts["logprobs"] else None,
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


def _stream_chunks(team: Team, response: dict[str, Any]):
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


def create_app(team: Team, *, api_key: str | None = None, tool_format: str = "auto") -> FastAPI:
    """The FastAPI app serving `team`. With `api_key`, /v1/* needs ``Authorization: Bearer <key>``.

    `tool_format`: how requests with ``tools`` are rendered: "auto" (the chat template when it renders
    tools, else the text format), "template" or "text" (`marft_lg.serving.tool_calls`).
    """
    if tool_format not in TOOL_FORMATS:
        raise ValueError(f"tool_format must be one of {TOOL_FORMATS}, got {tool_format!r}")
    app = FastAPI(title="marft_lg serving", version="0.1.0")
    app.state.team = team

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            given = request.headers.get("authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return _error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
        return await call_next(request)

    async def _json(request: Request) -> Any:
        try:
            return await request.json()
        except (ValueError, UnicodeDecodeError) as e:
            raise _BadRequest(f"the request body is not valid JSON: {e}") from None

    def _handle(e: Exception, registry_status: int = 400):
        if isinstance(e, _BadRequest):
            return _error(400, str(e), e.param)
        if isinstance(e, UnknownAgentError):
            return _error(404, str(e), "model")
        if isinstance(e, RegistryError):
            return _error(registry_status, str(e), "model" if registry_status == 404 else None)
        if isinstance(e, (ContextLengthError, AdapterMismatchError, RegistryError, ValueError)):
            return _error(400, str(e))
        raise e

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        created = int(time.time())
        data = []
        for mid in known_models(team):
            base = mid == team.model_name
            data.append({"id": mid, "object": "model", "created": created, "owned_by": "marft_lg",
                         "root": mid if base else team.model_name, "parent": None if base else team.model_name,
                         "max_model_len": team.engine.max_context()})
        return {"object": "list", "data": data}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        try:
            reqs, opts = parse_chat_body(await _json(request), team, tool_format)
            completions = await team.achat(reqs)
        except Exception as e:  # noqa: BLE001 - mapped to HTTP errors, anything else re-raised
            return _handle(e, registry_status=404)
        response = completion_response(team, completions, opts)
        if opts["stream"]:
            return StreamingResponse(_stream_chunks(team, response), media_type="text/event-stream")
        return response

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        try:
            body = await _json(request)
            if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str) \
                    or not isinstance(body.get("lora_path"), str):
                raise _BadRequest("body must be {\"lora_name\": str, \"lora_path\": str}")
            if team.registry is None:
                raise _BadRequest("this server has no adapter registry (start it with --registry DIR)")
            slot, version = team.registry.locate(body["lora_path"])
            role, _, pinned = body["lora_name"].partition("@")
            if role not in team.agents():
                raise UnknownAgentError(body["lora_name"], team.agents(), what="agent")
            if team.adapter_name(role).split("@")[0] != slot:
                raise _BadRequest(f"lora_path {body['lora_path']} holds adapters of {slot!r}, not of {role!r}")
            if pinned and pinned != version:
                raise _BadRequest(f"lora_name {body['lora_name']!r} does not match the version at lora_path ({version})")
            if pinned:
                await asyncio.to_thread(team.adapter_name, role, version)
            else:
                await asyncio.to_thread(team.load_version, role, version)
        except Exception as e:  # noqa: BLE001
            return _handle(e)
        return {"status": "ok", "lora_name": body["lora_name"], "version": version, "versions": team.versions()}

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

    return app
