"""The OpenAI chat-completions wire format of `marft-lg serve`: a request body -> `ChatRequest`s (model, sampling,
tools, the caller's baggage defaults), and `Completion`s -> the response JSON or its server-sent events.

`model` is a role (its current adapter), ``role@version`` (a pinned version) or a base model name (adapters off).
`return_token_ids` adds `prompt_token_ids` to the response and `token_ids` to each choice, as vLLM does;
`return_tokens_as_token_ids` (with `logprobs`) writes each log-prob entry's token as ``token_id:{id}``, also as vLLM
does. Tools: `tools`, `tool_choice` and `parallel_tool_calls` are honoured as OpenAI/vLLM do; the prompt shows the
tools through the model's chat template when it renders tools, else in the text format of `marft_lg.tool_calls`;
the completion's ``<tool_call>`` blocks come back as ``message.tool_calls`` with ``finish_reason: "tool_calls"``,
malformed ones stay in ``content`` and are listed in ``message.invalid_tool_calls``. A forced call (``tool_choice``
"required" or a named function), ``response_format`` json_object / json_schema and vLLM's ``structured_outputs``
(json, json_object, grammar) are decoded under a grammar (`marft_lg.constraints`), as vLLM does.
"""

from __future__ import annotations

import functools
import json
import time
import uuid
from typing import Any

import orjson

from marft_lg.constraints import ConstraintError, check_constraint, constraint_for
from marft_lg.serving.errors import UnknownAgentError
from marft_lg.serving.http.served_spans import CallContext
from marft_lg.serving.http.transport import BadRequest
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

TOOL_FORMATS = ("auto", "template", "text")
MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool", "function")
"""OpenAI's message roles: another is a caller's mistake that a chat template would render as if it meant something."""
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_LOGPROB_ENTRIES = 2_000_000
"""Most log-prob entries one answer may hold (n x max_tokens x (top_logprobs + 1)): ~85 bytes each in the JSON."""


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise BadRequest(f"{name} must be a number, got {value!r}", name)
    if not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"{name} must be {names}, got {type(value).__name__}", name)
    return value


def _parse_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest("tools must be a list of {\"type\": \"function\", \"function\": {\"name\", ...}}", "tools")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type", "function") != "function" \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                              f"\"description\": str, \"parameters\": JSON schema}}}}, got {tool!r:.200}", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        problem = _schema_problem(json.dumps(fn["parameters"], sort_keys=True)) if fn.get("parameters") else None
        if problem:
            raise BadRequest(f"tools[{i}].function.parameters is not a valid JSON schema: {problem}", "tools")
        out.append({"type": "function", "function": fn})
    return out or None


@functools.lru_cache(maxsize=256)
def _schema_problem(schema_json: str) -> str | None:
    """Why a tool's parameters (as canonical JSON) are not a JSON schema (Draft 2020-12), or None. Checked once per
    distinct schema: the prompt, the grammar and the recorded argument check all read it, and a bad one (e.g.
    ``"required": 7``) must be the caller's 400, not a 500 halfway through."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(json.loads(schema_json))
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        return f"{where + ': ' if where else ''}{exc.message}"[:300]
    except RecursionError:
        return "nested too deeply"
    return None


def _parse_tool_choice(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | dict[str, Any]:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        if choice == "required" and not tools:
            raise BadRequest("tool_choice 'required' needs tools", "tool_choice")
        return choice
    name = choice_name(choice) if isinstance(choice, dict) else None
    if name is None:
        raise BadRequest("tool_choice must be 'auto', 'none', 'required' or "
                          "{\"type\": \"function\", \"function\": {\"name\": str}}", "tool_choice")
    if name not in tool_names(tools):
        raise BadRequest(f"tool_choice names {name!r}, which is not in tools ({tool_names(tools)})", "tool_choice")
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


def parse_chat_body(body: Any, team: ServedTeam, tool_format: str = "auto", context: CallContext | None = None,
                    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES) -> tuple[list[ChatRequest], dict[str, Any]]:
    """A /v1/chat/completions JSON body -> one ChatRequest per choice, plus response options (``base``: the
    name of the base model that answers, ``agent``: the role, None for a base model name). `context`: the caller's
    baggage; its version pin and seed apply where the body names none (``model: role@version`` and ``seed`` win).
    `max_logprob_entries`: a request whose answer could hold more log-prob entries is refused (400)."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' is required: an agent role, 'role@version', or the base model name", "model")
    agent, version, base = _parse_model(model, team)
    if version is None and context is not None:
        version = context.version_for(agent)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {role, content} objects", "messages")
    for i, m in enumerate(messages):
        if isinstance(m, dict) and m.get("role") not in MESSAGE_ROLES:
            raise BadRequest(f"messages[{i}].role must be one of {', '.join(MESSAGE_ROLES)}, got "
                             f"{m.get('role')!r:.60}", "messages")
    max_tokens = _field(body, "max_completion_tokens", int, None) or _field(body, "max_tokens", int, 256)
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise BadRequest("stop must be a string or a list of strings", "stop")
    n = _field(body, "n", int, 1)
    if not 1 <= n <= 16:
        raise BadRequest(f"n must be in [1, 16], got {n}", "n")
    logprobs = bool(_field(body, "logprobs", bool, False))
    top_logprobs = _field(body, "top_logprobs", int, 0)
    if top_logprobs and not logprobs:
        raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
    if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}", "top_logprobs")
    if logprobs and n * max_tokens * (top_logprobs + 1) > max_logprob_entries:
        raise BadRequest(f"n x max_tokens x (top_logprobs + 1) = {n} x {max_tokens} x {top_logprobs + 1} log-prob "
                         f"entries is more than one answer may hold ({max_logprob_entries}); lower top_logprobs, n or "
                         "max_tokens", "top_logprobs" if top_logprobs else ("n" if n > 1 else "max_tokens"))
    seed = _field(body, "seed", int, None)
    if seed is not None and not -(2**63) <= seed <= 2**63 - 1 - n:
        raise BadRequest(f"seed must be a 64-bit integer, got {seed}", "seed")
    if seed is None and context is not None:
        seed = context.seed
    tools = _parse_tools(body)
    tool_choice = _parse_tool_choice(body, tools)
    parallel = bool(_field(body, "parallel_tool_calls", bool, True))
    chat, template_tools = prompt_messages(team, messages, tools, tool_choice, parallel, tool_format,
                                           tokenizer=tokenizer_of(team, agent, base))
    try:
        constraint = constraint_for(tools, tool_choice, body.get("parallel_tool_calls"), body.get("response_format"),
                                    body.get("structured_outputs"))
        check_constraint(constraint)
    except ConstraintError as exc:
        raise BadRequest(str(exc), exc.field) from exc
    reqs = [
        ChatRequest(
            messages=chat, agent=agent, version=version, max_tokens=max_tokens, tools=template_tools,
            temperature=float(_field(body, "temperature", (int, float), 1.0)),
            top_p=float(_field(body, "top_p", (int, float), 1.0)), stop=stop or None,
            seed=None if seed is None else seed + i, top_logprobs=top_logprobs,
            ignore_eos=bool(_field(body, "ignore_eos", bool, False)), constraint=constraint,
        )
        for i in range(n)
    ]
    opts = {"model": model, "base": base, "agent": agent, "logprobs": logprobs, "return_token_ids": bool(_field(body, "return_token_ids", bool, False)),
            "tokens_as_ids": bool(_field(body, "return_tokens_as_token_ids", bool, False)),
            "stream": bool(_field(body, "stream", bool, False)),
            "tool_names": tool_names(tools) if tools_active(tools, tool_choice) else None,
            "tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel, "constraint": constraint}
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


def logprob_entries(tok: Any, ids: list[int], lps: list[float], tops: list[dict[int, float]] | None = None,
                    tokens_as_ids: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``logprobs.content`` entries of sampled tokens; `tokens_as_ids`: tokens as ``token_id:{id}``
    (vLLM's `return_tokens_as_token_ids`)."""
    @functools.cache
    def token(i: int) -> str:
        return f"token_id:{i}" if tokens_as_ids else tok.decode([i])

    tops = tops or []
    content = []
    for k, (t, lp) in enumerate(zip(ids, lps, strict=True)):
        text = token(t)
        entry = {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
        if k < len(tops):
            entry["top_logprobs"] = [
                {"token": (s := token(i)), "logprob": v, "bytes": list(s.encode())} for i, v in tops[k].items()
            ]
        content.append(entry)
    return content


def _logprobs_block(tok: Any, c: Completion, tokens_as_ids: bool = False) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice."""
    return {"content": logprob_entries(tok, c.completion_token_ids, c.logprobs, c.extra.get("top_logprobs"),
                                       tokens_as_ids)}


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


def completion_response(team: ServedTeam, completions: list[Completion], opts: dict[str, Any],
                        response_id: str | None = None) -> dict[str, Any]:
    """OpenAI chat.completion JSON (vLLM's extra fields when asked); log-prob tokens decoded by the tokenizer
    of the base model that answered. `response_id`: the id a stream already announced."""
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
        "id": response_id or f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": opts["model"], "choices": choices,
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c.completion_token_ids) for c in completions),
                  "total_tokens": len(prompt) + sum(len(c.completion_token_ids) for c in completions)},
        "marft": {"agent": completions[0].agent, "adapter_version": completions[0].adapter_version,
                  "logprobs_masked": bool(completions[0].extra.get("logprobs_masked"))},
    }
    if opts["return_token_ids"]:
        out["prompt_token_ids"] = prompt
    return out


def encoded_response(team: ServedTeam, completions: list[Completion], opts: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """`completion_response` and its JSON bytes (orjson; megabytes with log-probs: build it off the event loop)."""
    response = completion_response(team, completions, opts)
    return response, orjson.dumps(response, option=orjson.OPT_NON_STR_KEYS)
