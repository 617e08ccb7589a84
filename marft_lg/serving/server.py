"""OpenAI-compatible HTTP server over a `Team`, with the endpoints and fields vLLM uses.

`model` is a role (its current adapter), ``role@version`` (a pinned version) or the base model
name (adapters off). `return_token_ids` adds `prompt_token_ids` to the response and `token_ids` to
each choice, as vLLM does, so the same client code reads both servers.
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
from marft_lg.serving.types import ChatRequest, Completion

_ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 500: "InternalServerError"}


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


def parse_chat_body(body: Any, team: Team) -> tuple[list[ChatRequest], dict[str, Any]]:
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
    reqs = [
        ChatRequest(
            messages=messages, agent=agent, version=version, max_tokens=max_tokens,
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)), stop=stop or None,
            seed=None if seed is None else seed + i, top_logprobs=top_logprobs,
            ignore_eos=bool(_field(body, "ignore_eos", bool, False)),
        )
        for i in range(n)
    ]
    opts = {"model": model, "logprobs": logprobs, "return_token_ids": bool(_field(body, "return_token_ids", bool, False)),
            "stream": bool(_field(body, "stream", bool, False))}
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


def completion_response(team: Team, completions: list[Completion], opts: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat.completion JSON (vLLM's extra fields when asked)."""
    choices = []
    for i, c in enumerate(completions):
        choice: dict[str, Any] = {
            "index": i, "message": {"role": "assistant", "content": c.text},
            "logprobs": _logprobs_block(team, c) if opts["logprobs"] else None,
            "finish_reason": c.finish_reason, "stop_reason": None,
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
    """Server-sent events for a finished completion (one content chunk per choice, then [DONE])."""
    base = {"id": response["id"], "object": "chat.completion.chunk", "created": response["created"],
            "model": response["model"]}
    for ch in response["choices"]:
        first = {**base, "choices": [{"index": ch["index"], "delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}]}
        yield f"data: {json.dumps(first)}\n\n"
        delta: dict[str, Any] = {"index": ch["index"], "delta": {"content": ch["message"]["content"]},
                                 "logprobs": ch["logprobs"], "finish_reason": ch["finish_reason"]}
        if "token_ids" in ch:
            delta["token_ids"] = ch["token_ids"]
        yield f"data: {json.dumps({**base, 'choices': [delta]})}\n\n"
    yield f"data: {json.dumps({**base, 'choices': [], 'usage': response['usage']})}\n\n"
    yield "data: [DONE]\n\n"


def create_app(team: Team, *, api_key: str | None = None) -> FastAPI:
    """The FastAPI app serving `team`. With `api_key`, /v1/* needs ``Authorization: Bearer <key>``."""
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
            reqs, opts = parse_chat_body(await _json(request), team)
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
