"""Generic OpenTelemetry GenAI semantic conventions (`gen_ai.operation.name`, `gen_ai.input.messages`, ...)."""

from __future__ import annotations

from typing import Any

import msgspec

from marft_lg.tracing.attributes import from_genai_messages
from marft_lg.trajectories.formats.base import (
    AGENT,
    LLM,
    OTHER,
    TOOL,
    WORKFLOW,
    SpanInfo,
    as_int,
    base_info,
    json_or,
)
from marft_lg.trajectories.otlp import C_READER, RawSpan, loads_json

NAME = "genai"
LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content", "completion"})


def detect(attrs: dict[str, Any]) -> bool:
    return "gen_ai.operation.name" in attrs


def parse(raw: RawSpan) -> SpanInfo:
    info = base_info(raw, NAME)
    fill(info, raw.attributes)
    return info


def fill(info: SpanInfo, a: dict[str, Any]) -> None:
    """Fill `info` from GenAI semconv attributes (shared with the OpenLLMetry and own formats)."""
    op = a.get("gen_ai.operation.name")
    info.session = info.session or a.get("gen_ai.conversation.id")
    if op in LLM_OPERATIONS:
        info.kind = LLM
        if "gen_ai.input.messages" in a or "gen_ai.output.messages" in a:
            info.raw_io = (a.get("gen_ai.input.messages"), a.get("gen_ai.system_instructions"),
                           a.get("gen_ai.output.messages"))
        else:
            info.messages = input_messages(a)
            info.completion, info.tool_calls = output_message(a)
        usage_and_model(info, a)
        info.agent = info.agent or a.get("gen_ai.agent.name")
    elif op == "execute_tool":
        info.kind = TOOL
        info.tool_name = a.get("gen_ai.tool.name") or info.name
        info.tool_call_id = a.get("gen_ai.tool.call.id")
        info.tool_args = json_or(a.get("gen_ai.tool.call.arguments"))
        info.tool_result = a.get("gen_ai.tool.call.result")
    elif op in ("invoke_agent", "create_agent"):
        info.kind = AGENT
        info.agent = a.get("gen_ai.agent.name") or info.name
    elif op == "invoke_workflow":
        info.kind = WORKFLOW
    else:
        info.kind = OTHER


def usage_and_model(info: SpanInfo, a: dict[str, Any]) -> None:
    """Token counts (current and legacy names) and the model that answered."""
    info.input_tokens = as_int(a.get("gen_ai.usage.input_tokens", a.get("gen_ai.usage.prompt_tokens")))
    info.output_tokens = as_int(a.get("gen_ai.usage.output_tokens", a.get("gen_ai.usage.completion_tokens")))
    model = a.get("gen_ai.response.model") or a.get("gen_ai.request.model")
    info.model = None if model in (None, "unknown") else str(model)


def materialise(info: SpanInfo) -> None:
    """Parse the prompt and completion kept as raw JSON text by `fill` (done once, at assembly)."""
    if info.raw_io is None:
        return
    raw_in, raw_system, raw_out = info.raw_io
    info.raw_io = None
    if raw_system is None and type(raw_in) is str and type(raw_out) is str:  # `input_messages`/`output_message`, typed
        messages = _typed_messages(raw_in)
        out = _typed_messages(raw_out)
        if messages is not None and out is not None:
            info.messages = messages
            info.completion = out[-1]["content"]
            info.tool_calls = info.tool_calls or out[-1].get("tool_calls") or None
            return
    a = {k: v for k, v in (("gen_ai.input.messages", raw_in), ("gen_ai.system_instructions", raw_system),
                           ("gen_ai.output.messages", raw_out)) if v is not None}
    info.messages = input_messages(a)
    completion, calls = output_message(a)
    info.completion = completion
    info.tool_calls = info.tool_calls or calls


class _TextPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True, gc=False):
    content: str


class _ToolCallPart(msgspec.Struct, tag="tool_call", tag_field="type", forbid_unknown_fields=True, gc=False):
    id: str | None = None
    name: str | None = None
    arguments: msgspec.Raw = msgspec.Raw(b"null")  # parsed by orjson, as the general path does


class _Message(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    parts: list[_TextPart | _ToolCallPart]
    role: str = "user"


_decode_messages = msgspec.json.Decoder(list[_Message]).decode
_c_messages = None
if C_READER is not None:
    C_READER.configure_genai(loads_json)
    _c_messages = C_READER.genai_messages


def _typed_messages(raw: str) -> list[dict[str, Any]] | None:
    """What `_genai_messages` gives for messages of text and tool-call parts, decoded in one typed pass (in C when
    built: `_otlp_c.genai_messages`, which declines the rarer shapes to the msgspec pass); None for anything else
    (other parts or keys, other types, no messages), which the general path then reads."""
    if _c_messages is not None:
        out = _c_messages(raw)
        if out is not None:
            return out
    try:
        data = _decode_messages(raw)
        out = []
        for m in data:
            parts = m.parts
            if len(parts) == 1 and type(parts[0]) is _TextPart:
                out.append({"role": m.role, "content": parts[0].content})
                continue
            texts, calls = [], []
            for p in parts:
                if type(p) is _TextPart:
                    texts.append(p.content)
                else:
                    calls.append({"id": p.id, "name": p.name, "args": loads_json(bytes(p.arguments))})
            msg = {"role": m.role, "content": "".join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
    except (msgspec.MsgspecError, ValueError, RecursionError):
        return None
    return out or None


def _genai_messages(raw: Any) -> list[dict[str, Any]]:
    if type(raw) is str:
        fast = _typed_messages(raw)
        if fast is not None:
            return fast
    data = loads_json(raw) if isinstance(raw, str | bytes) else raw
    if not isinstance(data, list):
        raise ValueError("not a list of messages")
    return _text_messages(data) or from_genai_messages(data)


def _text_messages(data: list[Any]) -> list[dict[str, Any]] | None:
    """`from_genai_messages` for messages of at most one text part each (nearly all prompts), without its
    general loop; None when any message is anything else."""
    out = []
    for m in data:
        if type(m) is not dict:
            return None
        parts = m.get("parts")
        if type(parts) is not list or len(parts) > 1:
            return None
        if parts:
            p = parts[0]
            if type(p) is not dict or p.get("type") != "text":
                return None
            out.append({"role": m.get("role", "user"), "content": str(p.get("content", ""))})
        elif "content" in m:
            return None
        else:
            out.append({"role": m.get("role", "user"), "content": ""})
    return out or None


def input_messages(a: dict[str, Any]) -> list[dict[str, Any]]:
    """Prompt in chat form from `gen_ai.input.messages` (+ `gen_ai.system_instructions`) or legacy `gen_ai.prompt.N.*`."""
    messages: list[dict[str, Any]] = []
    raw = a.get("gen_ai.input.messages")
    if raw is not None:
        try:
            messages = _genai_messages(raw)
        except (ValueError, TypeError, AttributeError):
            messages = [{"role": "user", "content": str(raw)}]
    else:
        messages = indexed_messages(a, "gen_ai.prompt.")
    system = a.get("gen_ai.system_instructions")
    if system is not None and not any(m.get("role") == "system" for m in messages):
        parts = json_or(system)
        if isinstance(parts, list):
            text = "".join(str(p.get("content", "")) if isinstance(p, dict) else str(p) for p in parts)
        else:
            text = str(parts)
        messages.insert(0, {"role": "system", "content": text})
    return messages


def output_message(a: dict[str, Any]) -> tuple[str, list[dict[str, Any]] | None]:
    """Completion text and the tool calls it requested."""
    raw = a.get("gen_ai.output.messages")
    if raw is not None:
        try:
            msgs = _genai_messages(raw)
        except (ValueError, TypeError, AttributeError):
            return str(raw), None
    else:
        msgs = indexed_messages(a, "gen_ai.completion.")
    if not msgs:
        return "", None
    last = msgs[-1]
    return str(last.get("content") or ""), last.get("tool_calls") or None


def indexed_messages(a: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Legacy flattened messages: `<prefix>N.role`, `<prefix>N.content`, `<prefix>N.tool_calls.M.name|arguments|id`."""
    by_index: dict[int, dict[str, Any]] = {}
    n = len(prefix)
    for key, value in a.items():
        if not key.startswith(prefix):
            continue
        idx, _, field = key[n:].partition(".")
        if not idx.isdigit():
            continue
        msg = by_index.setdefault(int(idx), {"role": "user", "content": ""})
        if field in ("role", "content"):
            msg[field] = value if field == "role" else str(value)
        elif field == "tool_call_id":
            msg["tool_call_id"] = value
        elif field.startswith("tool_calls."):
            t_idx, _, t_field = field[len("tool_calls."):].partition(".")
            if t_idx.isdigit():
                calls = msg.setdefault("tool_calls", [])
                while len(calls) <= int(t_idx):
                    calls.append({"id": None, "name": None, "args": None})
                t_field = "args" if t_field == "arguments" else t_field
                calls[int(t_idx)][t_field] = json_or(value) if t_field == "args" else value
    return [by_index[i] for i in sorted(by_index)]
