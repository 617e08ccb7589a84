"""OpenInference (`openinference-instrumentation-langchain`), declared for the engine (`formats/engine.py`):
`openinference.span.kind`, flattened `llm.input_messages.N.message.*`, the LangGraph context in the `metadata` JSON,
`session.id`."""

from __future__ import annotations

from typing import Any

from marft_lg.tracing.attributes import agent_from_namespace
from marft_lg.trajectories.formats.base import (
    AGENT,
    LLM,
    OTHER,
    TOOL,
    WORKFLOW,
    SpanInfo,
    as_int,
    as_list,
    as_str,
    json_or,
    tool_result_text,
)
from marft_lg.trajectories.formats.engine import (
    SPAN_NAME,
    Attr,
    Derive,
    Format,
    Kind,
    Member,
    as_name,
    interned,
)

NAME = "openinference"
KIND_KEY = "openinference.span.kind"
_CACHE_SIZE = 4096
_documents: dict[str, dict[str, Any]] = {}


def metadata(a: dict[str, Any]) -> dict[str, Any]:
    """The run's `metadata` JSON object ({} when absent or not an object). The spans of one node run carry the same
    text, so each distinct text is parsed once (the dict is shared, never changed)."""
    value = a.get("metadata")
    if type(value) is str:
        hit = _documents.get(value)
        if hit is not None:
            return hit
    doc = json_or(value, {})
    doc = doc if isinstance(doc, dict) else {}
    if type(value) is str:
        if len(_documents) >= _CACHE_SIZE:
            _documents.clear()
        _documents[value] = doc
    return doc


def _is_chain(a: dict[str, Any]) -> bool:
    return str(a.get(KIND_KEY)).upper() == "CHAIN"


def _chain(info: SpanInfo, a: dict[str, Any], kind: str) -> str:
    """A CHAIN span is a LangGraph node's own span (an agent) when it is named after its node, the workflow when it
    is the root, else neither."""
    if kind != OTHER or not _is_chain(a):
        return kind
    if info.node and info.name == info.node:
        return AGENT
    return WORKFLOW if info.parent_id is None else OTHER


def _chain_outside_node(info: SpanInfo, a: dict[str, Any]) -> None:
    """A CHAIN span inside a node that is not the node's own span (a router, a runnable) names no agent."""
    if info.kind == OTHER and info.name != info.node and _is_chain(a):
        info.agent = None


def _agent(info: SpanInfo, a: dict[str, Any], ctx: dict[str, Any]) -> tuple[Any]:
    return (interned(agent_from_namespace(info.task, info.node)),)


def _llm_io(info: SpanInfo, a: dict[str, Any], ctx: dict[str, Any]) -> tuple[Any, ...]:
    """(messages, completion, tool_calls): the completion is the last output message."""
    messages, out = io_messages(a)
    if not out:
        return messages, "", None
    return messages, str(out[-1].get("content") or ""), out[-1].get("tool_calls") or None


def _workflow_metadata(info: SpanInfo, a: dict[str, Any], ctx: dict[str, Any]) -> tuple[Any]:
    """The user's metadata of a run: the `metadata` JSON without LangGraph's and LangSmith's own keys."""
    return ({k: v for k, v in ctx.items() if not str(k).startswith(("langgraph_", "ls_", "checkpoint"))} or None,)


FORMAT = Format(
    NAME,
    detect=lambda a: KIND_KEY in a,
    context=metadata,
    fields=(Attr("node", Member("langgraph_node"), as_name),
            Attr("task", (Member("langgraph_checkpoint_ns"), Member("checkpoint_ns")), as_name),
            Derive(("agent",), _agent),
            Attr("step", Member("langgraph_step"), as_int),
            Attr("triggers", Member("langgraph_triggers"), as_list),
            Attr("session", ("session.id", Member("thread_id"), Member("session_id"), Member("conversation_id")),
                 interned),
            Attr("scenario_id", Member("scenario_id"), as_name)),
    kind=Kind(KIND_KEY, {"LLM": LLM, "TOOL": TOOL, "AGENT": AGENT}, normalise=lambda v: str(v).upper(), rule=_chain),
    by_kind={LLM: (Derive(("messages", "completion", "tool_calls"), _llm_io),
                   Attr("input_tokens", "llm.token_count.prompt", as_int),
                   Attr("output_tokens", "llm.token_count.completion", as_int),
                   Attr("model", "llm.model_name", as_name)),
             TOOL: (Attr("tool_name", ("tool.name", SPAN_NAME), as_name),
                    Attr("tool_call_id", "tool_call.id"),
                    Attr("tool_args", ("tool.parameters", "input.value"), json_or, pick="present"),
                    Attr("tool_result", "output.value", tool_result_text)),
             AGENT: (Attr("agent", SPAN_NAME, as_name, mode="fill"),),
             WORKFLOW: (Attr("outcome", "output.value", as_str), Derive(("metadata",), _workflow_metadata))},
    refine=(_chain_outside_node,),
)


_IN, _OUT = "llm.input_messages.", "llm.output_messages."


def io_messages(a: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The input and output chat messages from `llm.{input,output}_messages.N.message.{role,content,tool_call_id,
    tool_calls.M.tool_call.*,contents.K.message_content.text}`, in one pass over the attributes (in key order)."""
    inputs: dict[int, dict[str, Any]] = {}
    outputs: dict[int, dict[str, Any]] = {}
    cache = _key_cache
    for key, value in a.items():
        where = cache.get(key, _UNSEEN)
        if where is _UNSEEN:
            where = _message_key(key)
        if where is None:
            continue
        output, idx, field = where
        by_index = outputs if output else inputs
        msg = by_index.get(idx)
        if msg is None:
            msg = by_index[idx] = {"role": "user", "content": ""}
        if field == "role":  # `_put`, inlined: it runs for every message field of every LLM span
            msg["role"] = value
        elif field == "content":
            msg["content"] = str(value)
        else:
            _set_field(msg, field, value)
    return ([inputs[i] for i in sorted(inputs)] if len(inputs) > 1 else list(inputs.values()),
            [outputs[i] for i in sorted(outputs)] if len(outputs) > 1 else list(outputs.values()))


_UNSEEN = object()
_key_cache: dict[str, tuple[bool, int, str] | None] = {}  # attribute key -> (output side, index, field) or None
_KEY_CACHE_SIZE = 8192


def _message_key(key: str) -> tuple[bool, int, str] | None:
    """Where an attribute key puts its value: (output side, message index, field), None for other keys
    (remembered: the same few keys repeat on every LLM span)."""
    where = None
    for output, prefix in ((False, _IN), (True, _OUT)):
        if key.startswith(prefix):
            parsed = _index_and_field(key[len(prefix):])
            where = None if parsed is None else (output, *parsed)
            break
    if len(_key_cache) >= _KEY_CACHE_SIZE:
        _key_cache.clear()
    _key_cache[key] = where
    return where


def _index_and_field(key: str) -> tuple[int, str] | None:
    """`N.message.<field>` -> (N, field); None for anything else."""
    idx, _, rest = key.partition(".")
    if not idx.isdigit() or not rest.startswith("message."):
        return None
    return int(idx), rest[len("message."):]


def _set_field(msg: dict[str, Any], field: str, value: Any) -> None:
    """A message field other than role and content."""
    if field == "tool_call_id":
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


