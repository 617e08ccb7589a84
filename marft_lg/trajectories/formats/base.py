"""`SpanInfo`: one span as mining understands it, whatever instrumentor wrote it; helpers shared by formats."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from marft_lg.trajectories.otlp import RawSpan, loads_json

LLM, TOOL, AGENT, WORKFLOW, FEEDBACK, OTHER = "llm", "tool", "agent", "workflow", "feedback", "other"


@dataclass(slots=True)
class SpanInfo:
    """The fields assembly needs, extracted once per span (the raw attribute dict is not kept)."""

    trace_id: str
    span_id: str
    parent_id: str | None
    name: str
    start_ns: int
    end_ns: int
    source: str
    fmt: str = "other"
    kind: str = OTHER
    error: bool = False
    error_message: str | None = None
    agent: str | None = None
    node: str | None = None  # the LangGraph node the span ran in, when the format names it
    episode_id: str | None = None  # explicit episode id (marft_lg's own spans)
    session: str | None = None  # conversation / thread / session id shared across traces
    scenario_id: str | None = None
    step: int | None = None
    triggers: list[str] | None = None
    task: str | None = None  # one execution of a node (checkpoint ns / task id)
    messages: list[dict[str, Any]] | None = None
    completion: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # calls requested by this LLM completion
    prompt_token_ids: Any = None
    completion_token_ids: Any = None
    completion_logprobs: Any = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    latency_s: float | None = None
    model: str | None = None
    adapter_version: str | None = None
    served: bool = False  # recorded by a marft_lg server for a request it answered (merged into the app's call)
    response_id: str | None = None  # the server's completion id (`gen_ai.response.id`), a join key
    choice: int | None = None  # which of the request's choices a server span records
    constraint: str | None = None  # JSON: the grammar the completion was decoded under (`marft_lg.constraints`)
    tool_name: str | None = None
    tool_args: Any = None
    tool_result: Any = None
    tool_call_id: str | None = None
    feedback_name: str | None = None
    feedback_value: Any = None
    feedback_thread: str | None = None  # feedback about a thread's episode (`record_feedback(thread_id=...)`)
    feedback_turn: int | None = None  # which of the thread's episodes, by start (None: the last before the feedback)
    feedback_trace: str | None = None  # feedback about the episode holding this trace
    outcome: str | None = None
    metadata: dict[str, Any] | None = None
    raw_io: tuple[Any, Any, Any] | None = None  # (input, system, output) GenAI JSON, parsed only when assembled


def base_info(raw: RawSpan, fmt: str) -> SpanInfo:
    """The format-independent part of a span (its name shared with the other spans of that name)."""
    if raw.error:  # positional: SpanInfo(trace_id, span_id, parent_id, name, start_ns, end_ns, source, fmt, kind, error, ...)
        return SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, sys.intern(raw.name), raw.start_ns, raw.end_ns,
                        raw.source, fmt, OTHER, True, error_message(raw))
    return SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, sys.intern(raw.name), raw.start_ns, raw.end_ns, raw.source,
                    fmt)


def error_message(raw: RawSpan) -> str:
    """The best description of a span's error: exception event, status message, or error.type."""
    for event in raw.events:
        if event.get("name") == "exception":
            a = event.get("attributes") or {}
            kind, msg = a.get("exception.type"), a.get("exception.message")
            if kind or msg:
                return f"{kind}: {msg}" if kind and msg else str(kind or msg)
    return raw.status_message or str(raw.attributes.get("error.type") or "error")


_JSON_STARTS = frozenset('{["-0123456789tfnNI')  # what a JSON text (or json's NaN/Infinity) starts with


def json_or(value: Any, default: Any = None) -> Any:
    """Parse JSON text; non-JSON text and non-strings come back as they are (or `default` when None)."""
    if value is None:
        return default
    if isinstance(value, str):
        head = value.lstrip(" \t\n\r")[:1]
        if not head or head not in _JSON_STARTS:  # plain text: skip two failing parsers
            return value
        try:
            return loads_json(value)
        except ValueError:  # orjson refuses what json accepts (NaN, huge ints, lone surrogates): ask json
            try:
                return json.loads(value)
            except ValueError:
                return value
    return value


def as_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def as_str(value: Any) -> str | None:
    """None and str as they are; any other value (an id sent as a number) as its str."""
    return value if value is None or type(value) is str else str(value)


def as_list(value: Any) -> list[str] | None:
    """A list attribute that may arrive as an OTLP array, a JSON list, or a Python tuple repr."""
    if value is None:
        return None
    if isinstance(value, list | tuple):
        return [str(v) for v in value]
    text = str(value).strip()
    parsed = json_or(text)
    if isinstance(parsed, list):
        return [str(v) for v in parsed]
    if text.startswith("(") and text.endswith(")"):
        return [p.strip().strip("'\"") for p in text[1:-1].split(",") if p.strip()]
    return [text]


def tool_result_text(value: Any) -> Any:
    """Unwrap serialised LangChain ToolMessages ({"output": {"kwargs": {"content": ...}}}) to their content."""
    data = json_or(value)
    for _ in range(3):
        if not isinstance(data, dict):
            break
        if "content" in data and not isinstance(data["content"], dict):
            return data["content"]
        data = data.get("output", data.get("kwargs", data.get("data")))
    return data


def messages_text(messages: list[dict[str, Any]] | None) -> str:
    """All message contents joined (what dependency detection searches earlier completions in)."""
    if not messages:
        return ""
    return "\n".join([str(m.get("content") or "") for m in messages])
