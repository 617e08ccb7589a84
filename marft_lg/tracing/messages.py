"""LangChain messages <-> plain chat dicts (``{"role","content",...}``), the form spans and engines use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from json.encoder import encode_basestring
from typing import Any

from langchain_core.messages import BaseMessage

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool", "function": "tool", "developer": "system"}


def content_text(content: Any) -> str:
    """Message content (a string or a list of content blocks) -> its text."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content or []:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
    return "".join(parts)


def message_to_dict(message: BaseMessage | dict[str, Any]) -> dict[str, Any]:
    """One LangChain message (or an already plain dict) -> ``{"role","content"}`` plus tool fields."""
    if isinstance(message, dict):
        return dict(message)
    kind = message.type
    role = _ROLES.get(kind) or getattr(message, "role", None) or kind
    out: dict[str, Any] = {"role": role, "content": content_text(message.content)}
    tool_calls = getattr(message, "tool_calls", None) if kind == "ai" or kind not in _ROLES else None
    if tool_calls:
        out["tool_calls"] = [{"id": tc.get("id"), "name": tc.get("name"), "args": tc.get("args")} for tc in tool_calls]
    if kind == "tool":
        out["tool_call_id"] = getattr(message, "tool_call_id", None)
    if getattr(message, "name", None):
        out["name"] = message.name
    return out


def messages_to_dicts(messages: Sequence[BaseMessage | dict[str, Any]]) -> list[dict[str, Any]]:
    return [message_to_dict(m) for m in messages]


_TEXT_ROLES = {"human": "user", "ai": "assistant", "system": "system"}


def genai_text_messages_json(messages: Sequence[Any]) -> str | None:
    """``to_genai_messages(messages_to_dicts(messages))`` for plain-text LangChain messages, without the dicts.

    None when a message is anything else (tool calls, tool results, content blocks, dicts): use the
    general path then. The bytes are the same as the general path's.
    """
    items = []
    for m in messages:
        role = _TEXT_ROLES.get(getattr(m, "type", None))
        content = getattr(m, "content", None)
        if role is None or type(content) is not str or (role == "assistant" and m.tool_calls):
            return None
        items.append(genai_text_message_json(role, content))
    return "[" + ", ".join(items) + "]"


def genai_text_message_json(role: str, text: str) -> str:
    """One GenAI message of role `role` with `text` as its only part (no part when empty), as JSON text."""
    part = '{"type": "text", "content": ' + encode_basestring(text) + "}" if text else ""
    return '{"role": "' + role + '", "parts": [' + part + "]}"


def redact_value(value: Any, redact: Callable[[str], str] | None) -> Any:
    """Apply `redact` to every string inside a JSON-like value."""
    if redact is None:
        return value
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v, redact) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact_value(v, redact) for v in value]
    return value


def redact_messages(messages: list[dict[str, Any]], redact: Callable[[str], str] | None) -> list[dict[str, Any]]:
    """Apply the user's redaction hook to every text a message carries (content and tool arguments)."""
    if redact is None:
        return messages
    out = []
    for m in messages:
        m = dict(m)
        m["content"] = redact(m.get("content") or "")
        if m.get("tool_calls"):
            m["tool_calls"] = [
                {**tc, "args": redact_value(tc.get("args"), redact)} for tc in m["tool_calls"]
            ]
        out.append(m)
    return out


def to_jsonable(value: Any) -> Any:
    """`json.dumps` default hook: messages become chat dicts, pydantic models dicts, the rest `str`."""
    if isinstance(value, BaseMessage):
        return message_to_dict(value)
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if isinstance(value, set | tuple):
        return list(value)
    return str(value)
