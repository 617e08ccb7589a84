"""Generic OpenTelemetry GenAI semantic conventions (`gen_ai.operation.name`, `gen_ai.input.messages`, ...), declared
for the engine (`formats/engine.py`). The own and OpenLLMetry formats build on these rules."""

from __future__ import annotations

from typing import Any

import msgspec

from marft_lg.tracing import attributes as A
from marft_lg.tracing.attributes import from_genai_messages
from marft_lg.trajectories.formats.base import AGENT, LLM, TOOL, WORKFLOW, SpanInfo, as_int, json_or
from marft_lg.trajectories.formats.engine import SPAN_NAME, Attr, Derive, Format, Kind, as_name, interned
from marft_lg.trajectories.otlp import loads_json

NAME = "genai"
LLM_OPERATIONS = frozenset({"chat", "text_completion", "generate_content", "completion"})
OPERATION_KINDS = {**dict.fromkeys(LLM_OPERATIONS, LLM), A.OP_TOOL: TOOL, A.OP_AGENT: AGENT, "create_agent": AGENT,
                   A.OP_WORKFLOW: WORKFLOW}
KIND = Kind(A.GEN_AI_OPERATION_NAME, OPERATION_KINDS)


def model_name(value: Any) -> str | None:
    """The model that answered; "unknown" (what some emitters write when they do not know) is no model."""
    return None if value is None or value == "unknown" else as_name(value)


def io(info: SpanInfo, a: dict[str, Any], ctx: Any = None) -> tuple[Any, ...]:
    """(raw_io, messages, completion, tool_calls): GenAI message JSON is kept as text and parsed at assembly
    (`materialise`, only for the calls that become actions); the legacy indexed attributes are read now."""
    if A.GEN_AI_INPUT_MESSAGES in a or A.GEN_AI_OUTPUT_MESSAGES in a:
        return (a.get(A.GEN_AI_INPUT_MESSAGES), a.get(A.GEN_AI_SYSTEM_INSTRUCTIONS), a.get(A.GEN_AI_OUTPUT_MESSAGES)), \
            None, None, None
    completion, calls = output_message(a)
    return None, input_messages(a), completion, calls


SESSION = Attr("session", A.GEN_AI_CONVERSATION_ID, interned, mode="fill")
USAGE = (Attr("input_tokens", (A.GEN_AI_USAGE_INPUT_TOKENS, "gen_ai.usage.prompt_tokens"), as_int, pick="present"),
         Attr("output_tokens", (A.GEN_AI_USAGE_OUTPUT_TOKENS, "gen_ai.usage.completion_tokens"), as_int, pick="present"),
         Attr("model", (A.GEN_AI_RESPONSE_MODEL, A.GEN_AI_REQUEST_MODEL), model_name))
LLM_FIELDS = (Derive(("raw_io", "messages", "completion", "tool_calls"), io), *USAGE,
              Attr("agent", A.GEN_AI_AGENT_NAME, as_name, mode="fill"),
              Attr("response_id", A.GEN_AI_RESPONSE_ID, as_name))
TOOL_FIELDS = (Attr("tool_name", (A.GEN_AI_TOOL_NAME, SPAN_NAME), as_name),
               Attr("tool_call_id", A.GEN_AI_TOOL_CALL_ID),
               Attr("tool_args", A.GEN_AI_TOOL_CALL_ARGUMENTS, json_or),
               Attr("tool_result", A.GEN_AI_TOOL_CALL_RESULT))
AGENT_FIELDS = (Attr("agent", (A.GEN_AI_AGENT_NAME, SPAN_NAME), as_name, mode="fill"),)

FORMAT = Format(NAME, detect=lambda a: A.GEN_AI_OPERATION_NAME in a, kind=KIND, fields=(SESSION,),
                by_kind={LLM: LLM_FIELDS, TOOL: TOOL_FIELDS, AGENT: AGENT_FIELDS})


def materialise(info: SpanInfo) -> None:
    """Parse the prompt and completion kept as raw JSON text by `io` (done once, at assembly)."""
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


def _typed_messages(raw: str) -> list[dict[str, Any]] | None:
    """What `_genai_messages` gives for messages of text and tool-call parts, decoded in one typed pass; None for
    anything else (other parts or keys, other types, no messages), which the general path then reads."""
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
    return from_genai_messages(data)


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
