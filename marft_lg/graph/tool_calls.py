"""The text format in which a served model calls tools, and its tolerant parser.

The model is told to answer with blocks (Hermes/Qwen/SmolLM style)::

    <tool_call>{"name": "search", "arguments": {"query": "otel"}}</tool_call>

Well-formed blocks naming a bound tool become LangChain ``tool_calls``; anything else (bad JSON,
no name, unknown tool, a block cut off by max_tokens) becomes an ``invalid_tool_calls`` entry whose
``error`` says what was wrong and what the format is, so the graph can show it to the model instead
of crashing.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FORMAT_HINT = f'{OPEN}{{"name": "<tool name>", "arguments": {{...}}}}{CLOSE}'
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*|\s*```$")


def tools_instruction(tools: Sequence[dict[str, Any]], tool_choice: str | None = None) -> str:
    """System-prompt text that lists the tools (OpenAI function schemas) and the call format."""
    lines = [
        "You can call tools. To call a tool, answer with one block per call, exactly in this format:",
        FORMAT_HINT,
        "Available tools:",
    ]
    for tool in tools:
        fn = tool.get("function", tool)
        lines.append(json.dumps({k: fn.get(k) for k in ("name", "description", "parameters")}, ensure_ascii=False))
    if tool_choice in ("any", "required"):
        lines.append("You must call at least one tool.")
    elif tool_choice and tool_choice not in ("auto", "none"):
        lines.append(f"You must call the tool {tool_choice!r}.")
    return "\n".join(lines)


def render_tool_call(name: str, args: Any) -> str:
    return f"{OPEN}{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}{CLOSE}"


def _call_id(index: int, body: str) -> str:
    return f"call_{index}_{hashlib.blake2b(body.encode('utf-8'), digest_size=4).hexdigest()}"


def parse_tool_calls(
    text: str, tool_names: Sequence[str] | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Split a completion's tool-call blocks into (valid ``tool_calls``, ``invalid_tool_calls``).

    Ids are derived from the block text, so the same completion always yields the same ids.
    """
    valid: list[dict[str, Any]] = []
    invalid: list[dict[str, Any]] = []
    for index, match in enumerate(_BLOCK.finditer(text)):
        raw = match.group(0)
        body = _FENCE.sub("", match.group(1).strip())
        call_id = _call_id(index, raw)
        if not raw.endswith(CLOSE):
            invalid.append(_invalid(call_id, None, body, f"tool call #{index + 1} is not closed with {CLOSE}"))
            continue
        try:
            data = json.loads(body)
        except json.JSONDecodeError as exc:
            invalid.append(_invalid(call_id, None, body, f"tool call #{index + 1} is not valid JSON ({exc.msg} at column {exc.colno})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not data["name"]:
            invalid.append(_invalid(call_id, None, body, f"tool call #{index + 1} has no \"name\" string"))
            continue
        name = data["name"]
        args = data.get("arguments", data.get("args", data.get("parameters", {})))
        if isinstance(args, str):
            with contextlib.suppress(json.JSONDecodeError):
                args = json.loads(args) if args.strip() else {}
        if not isinstance(args, dict):
            invalid.append(_invalid(call_id, name, body, f"tool call #{index + 1} ({name}): \"arguments\" must be a JSON object"))
            continue
        if tool_names is not None and name not in tool_names:
            invalid.append(
                _invalid(call_id, name, body, f"tool call #{index + 1} names unknown tool {name!r}; available: {sorted(tool_names)}")
            )
            continue
        valid.append({"name": name, "args": args, "id": call_id, "type": "tool_call"})
    return valid, invalid


def _invalid(call_id: str, name: str | None, body: str, reason: str) -> dict[str, Any]:
    return {
        "name": name,
        "args": body,
        "id": call_id,
        "error": f"{reason}. Call tools as {FORMAT_HINT}",
        "type": "invalid_tool_call",
    }
