"""OpenInference (`openinference-instrumentation-langchain`): `openinference.span.kind`, flattened
`llm.input_messages.N.message.*`, LangGraph context in the `metadata` JSON, `session.id`."""

from __future__ import annotations

from typing import Any

from marft_lg.trajectories.formats.base import (
    AGENT,
    LLM,
    TOOL,
    WORKFLOW,
    SpanInfo,
    agent_from_checkpoint_ns,
    as_int,
    as_list,
    base_info,
    json_or,
    tool_result_text,
)
from marft_lg.trajectories.otlp import RawSpan

NAME = "openinference"


def detect(attrs: dict[str, Any]) -> bool:
    return "openinference.span.kind" in attrs


def parse(raw: RawSpan) -> SpanInfo:
    a = raw.attributes
    info = base_info(raw, NAME)
    kind = str(a.get("openinference.span.kind", "")).upper()
    meta = json_or(a.get("metadata"), {})
    meta = meta if isinstance(meta, dict) else {}
    node = meta.get("langgraph_node")
    ns = meta.get("langgraph_checkpoint_ns") or meta.get("checkpoint_ns")
    info.agent = agent_from_checkpoint_ns(ns, node)
    info.step = as_int(meta.get("langgraph_step"))
    info.triggers = as_list(meta.get("langgraph_triggers"))
    info.task = ns
    info.session = a.get("session.id") or meta.get("thread_id") or meta.get("session_id") or meta.get("conversation_id")
    info.scenario_id = meta.get("scenario_id")
    if kind == "LLM":
        info.kind = LLM
        info.messages, out = io_messages(a)
        if out:
            info.completion = str(out[-1].get("content") or "")
            info.tool_calls = out[-1].get("tool_calls") or None
        else:
            info.completion = ""
        info.input_tokens = as_int(a.get("llm.token_count.prompt"))
        info.output_tokens = as_int(a.get("llm.token_count.completion"))
        info.model = a.get("llm.model_name")
    elif kind == "TOOL":
        info.kind = TOOL
        info.tool_name = a.get("tool.name") or info.name
        info.tool_call_id = a.get("tool_call.id")
        info.tool_args = json_or(a.get("tool.parameters", a.get("input.value")))
        info.tool_result = tool_result_text(a.get("output.value"))
    elif kind == "AGENT" or (kind == "CHAIN" and node and raw.name == node):
        info.kind = AGENT
        info.agent = info.agent or raw.name
    elif kind == "CHAIN" and raw.parent_id is None:
        info.kind = WORKFLOW
        info.outcome = a.get("output.value")
        info.metadata = {k: v for k, v in meta.items() if not k.startswith(("langgraph_", "ls_", "checkpoint"))} or None
    else:
        info.agent = None if kind == "CHAIN" and raw.name != node else info.agent
    return info


_IN, _OUT = "llm.input_messages.", "llm.output_messages."


def io_messages(a: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`flat_messages` of the input and of the output side, in one pass over the attributes."""
    inputs: dict[int, dict[str, Any]] = {}
    outputs: dict[int, dict[str, Any]] = {}
    for key, value in a.items():
        if key.startswith(_IN):
            _add_field(inputs, key[len(_IN):], value)
        elif key.startswith(_OUT):
            _add_field(outputs, key[len(_OUT):], value)
    return [inputs[i] for i in sorted(inputs)], [outputs[i] for i in sorted(outputs)]


def flat_messages(a: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """`llm.input_messages.N.message.{role,content,tool_call_id,tool_calls.M.tool_call.*,contents.K...}` -> chat messages."""
    by_index: dict[int, dict[str, Any]] = {}
    n = len(prefix)
    for key, value in a.items():
        if key.startswith(prefix):
            _add_field(by_index, key[n:], value)
    return [by_index[i] for i in sorted(by_index)]


def _add_field(by_index: dict[int, dict[str, Any]], key: str, value: Any) -> None:
    """One `N.message.<field>` attribute into message N."""
    idx, _, rest = key.partition(".")
    if not idx.isdigit() or not rest.startswith("message."):
        return
    field = rest[len("message."):]
    msg = by_index.get(int(idx))
    if msg is None:
        msg = by_index[int(idx)] = {"role": "user", "content": ""}
    if field == "role":
        msg["role"] = value
    elif field == "content":
        msg["content"] = str(value)
    elif field == "tool_call_id":
        msg["tool_call_id"] = value
    elif field.startswith("contents.") and field.endswith("message_content.text"):
        msg["content"] = str(msg.get("content") or "") + str(value)
    elif field.startswith("tool_calls."):
        t_idx, _, t_field = field[len("tool_calls."):].partition(".")
        if not t_idx.isdigit():
            return
        calls = msg.setdefault("tool_calls", [])
        while len(calls) <= int(t_idx):
            calls.append({"id": None, "name": None, "args": None})
        if t_field == "tool_call.id":
            calls[int(t_idx)]["id"] = value
        elif t_field == "tool_call.function.name":
            calls[int(t_idx)]["name"] = value
        elif t_field == "tool_call.function.arguments":
            calls[int(t_idx)]["args"] = json_or(value)
