"""What a LangChain chat model's answer carries, written onto its `chat` span: the completion and its tool calls
(malformed ones as errors), the engine's token ids and log-probs (`TeamChatModel`'s response metadata, or
OpenAI-style log-probs, whose ``token_id:{id}`` tokens give the ids), the adapter and role that answered, the
server's response id, finish reason and usage."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from marft_lg.constraints import constraint_key
from marft_lg.tool_calls import OPEN, parse_tool_calls
from marft_lg.tracing import attributes as A
from marft_lg.tracing.messages import (
    content_text,
    genai_text_message_json,
    redact_messages,
    redact_value,
    to_jsonable,
)
from marft_lg.tracing.records import SpanRecord

UNRESOLVED_MODEL = "marft-team"  # TeamChatModel's label before it knows which engine answers
_UNRESOLVED_SPAN = f"{A.OP_CHAT} {UNRESOLVED_MODEL}"


def record_response(span: SpanRecord, response: Any, *, capture_messages: bool,
                    redact: Callable[[str], str] | None) -> None:
    """Fill `span` from an `LLMResult` (its first generation)."""
    gen = _first_generation(response)
    message = getattr(gen, "message", None)
    rmeta = getattr(message, "response_metadata", None) or {}
    meta = rmeta.get(A.RESPONSE_METADATA_KEY) or {}
    text = content_text(message.content) if message is not None else str(getattr(gen, "text", "") or "")
    _output(span.attributes, message, text, capture_messages, redact)
    prompt_ids, completion_ids = _tokens(span.attributes, meta, rmeta)
    _engine(span, meta, rmeta)
    response_id = _response_id(response, message, rmeta)
    if response_id:
        span.attributes[A.GEN_AI_RESPONSE_ID] = response_id
    finish = meta.get("finish_reason") or rmeta.get("finish_reason") or (
        getattr(gen, "generation_info", None) or {}).get("finish_reason")
    if finish:
        span.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] = [str(finish)]
    usage = getattr(message, "usage_metadata", None) or {}
    n_in = usage.get("input_tokens", len(prompt_ids) if prompt_ids is not None else None)
    n_out = usage.get("output_tokens", len(completion_ids) if completion_ids is not None else None)
    if n_in is not None:
        span.attributes[A.GEN_AI_USAGE_INPUT_TOKENS] = int(n_in)
    if n_out is not None:
        span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] = int(n_out)


def _output(attrs: dict[str, Any], message: Any, text: str, capture_messages: bool,
            redact: Callable[[str], str] | None) -> None:
    """The tool calls (a malformed one is an error, whichever client kept it) and the output message."""
    tool_calls = [{"id": tc.get("id"), "name": tc.get("name"), "args": tc.get("args")}
                  for tc in (getattr(message, "tool_calls", None) or [])]
    invalid = [{"id": tc.get("id"), "name": tc.get("name"), "args": tc.get("args"), "error": tc.get("error")}
               for tc in (getattr(message, "invalid_tool_calls", None) or [])]
    if not invalid and OPEN in text:  # a malformed block a client left in the content (ChatOpenAI drops the
        invalid = _malformed_blocks(text)  # server's invalid_tool_calls field): still a tool error
    if tool_calls or invalid:
        attrs[A.MARFT_TOOL_CALLS] = json.dumps(redact_value(tool_calls + invalid, redact), ensure_ascii=False,
                                               default=to_jsonable)
    if not capture_messages:
        return
    if tool_calls or redact is not None:
        out = {"role": "assistant", "content": text}
        if tool_calls:
            out["tool_calls"] = tool_calls
        attrs[A.GEN_AI_OUTPUT_MESSAGES] = A.to_genai_messages(redact_messages([out], redact))
    else:
        attrs[A.GEN_AI_OUTPUT_MESSAGES] = "[" + genai_text_message_json("assistant", text) + "]"


def _tokens(attrs: dict[str, Any], meta: dict[str, Any], rmeta: dict[str, Any]) -> tuple[Any, Any]:
    """The token ids and log-probs the client kept: `TeamChatModel`'s, else OpenAI-style log-probs."""
    prompt_ids = meta.get("prompt_token_ids")
    completion_ids = meta.get("completion_token_ids")
    logprobs = meta.get("logprobs")
    if logprobs is None:
        logprobs = _openai_logprobs(rmeta.get("logprobs"))
    if completion_ids is None:  # vLLM's return_tokens_as_token_ids: the tokens are "token_id:{id}"
        completion_ids = _openai_token_ids(rmeta.get("logprobs"))
    if prompt_ids is not None:
        attrs[A.MARFT_PROMPT_TOKEN_IDS] = A.encode_ints(prompt_ids)
    if completion_ids is not None:
        attrs[A.MARFT_COMPLETION_TOKEN_IDS] = A.encode_ints(completion_ids)
    if logprobs is not None:
        attrs[A.MARFT_COMPLETION_LOGPROBS] = A.encode_floats(logprobs)
    return prompt_ids, completion_ids


def _engine(span: SpanRecord, meta: dict[str, Any], rmeta: dict[str, Any]) -> None:
    """What `TeamChatModel` says about the engine that answered: adapter, version, role, seed, call index, model."""
    attrs = span.attributes
    if meta.get("adapter_version") is not None:
        attrs[A.MARFT_ADAPTER_VERSION] = str(meta["adapter_version"])
    if "agent" in meta:
        attrs[A.MARFT_ADAPTER_NAME] = meta.get("agent") or ""
    role = meta.get("role")
    if role:
        if type(role) is not str or attrs.get(A.MARFT_AGENT_ROLE) != role:
            span.group = None  # a task attribute changes: this span's attributes are encoded on their own
        attrs[A.MARFT_AGENT_ROLE] = role
    if meta.get("seed") is not None:
        attrs[A.GEN_AI_REQUEST_SEED] = int(meta["seed"])
    if meta.get("call_index") is not None:
        attrs[A.MARFT_CALL_INDEX] = int(meta["call_index"])
    if meta.get("constraint"):
        attrs[A.MARFT_CONSTRAINT] = constraint_key(meta["constraint"])
    model = meta.get("model") or rmeta.get("model_name") or rmeta.get("model")
    if model:
        attrs[A.GEN_AI_RESPONSE_MODEL] = str(model)
        if meta and span.name == _UNRESOLVED_SPAN:  # TeamChatModel learns its engine only when the call runs
            attrs[A.GEN_AI_REQUEST_MODEL] = str(model)
            span.name = f"{A.OP_CHAT} {model}"


def _first_generation(response: Any) -> Any:
    try:
        return response.generations[0][0]
    except (AttributeError, IndexError, TypeError):
        return None


def _malformed_blocks(text: str) -> list[dict[str, Any]]:
    """The tool-call blocks in a completion's text that do not parse (the shared format's parser)."""
    return [{"id": tc["id"], "name": tc["name"], "args": tc["args"], "error": tc["error"]}
            for tc in parse_tool_calls(text)[1]]


def _response_id(response: Any, message: Any, rmeta: dict[str, Any]) -> str | None:
    """The server's id of the completion (OpenAI's ``chatcmpl-...``), wherever the client kept it."""
    llm_output = getattr(response, "llm_output", None) or {}
    for value in (rmeta.get("id"), llm_output.get("id") if isinstance(llm_output, dict) else None,
                  getattr(message, "id", None)):
        if isinstance(value, str) and value and not value.startswith(("run-", "lc_run-")):
            return value
    return None


def _openai_token_ids(value: Any) -> list[int] | None:
    """OpenAI-style log-probs whose every token is ``token_id:{id}`` (vLLM's and `marft-lg serve`'s
    `return_tokens_as_token_ids`) -> the completion's token ids; None for plain text tokens."""
    if not (isinstance(value, dict) and isinstance(value.get("content"), list) and value["content"]):
        return None
    ids = []
    for entry in value["content"]:
        token = entry.get("token") if isinstance(entry, dict) else None
        if not (isinstance(token, str) and token.startswith("token_id:") and token[9:].isascii() and token[9:].isdigit()):
            return None
        ids.append(int(token[9:]))
    return ids


def _openai_logprobs(value: Any) -> list[float] | None:
    """OpenAI-style ``{"content": [{"token","logprob"}, ...]}`` -> list of log-probs."""
    if isinstance(value, dict) and isinstance(value.get("content"), list):
        try:
            return [float(t["logprob"]) for t in value["content"]]
        except (KeyError, TypeError, ValueError):
            return None
    return None
