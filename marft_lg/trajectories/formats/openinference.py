"""OpenInference (`openinference-instrumentation-langchain`): `openinference.span.kind`, flattened
`llm.input_messages.N.message.*`, LangGraph context in the `metadata` JSON, `session.id`."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from marft_lg.trajectories import otlp
from marft_lg.trajectories.formats.base import (
    AGENT,
    C_SPAN_INFO,
    LLM,
    OTHER,
    TOOL,
    WORKFLOW,
    SpanInfo,
    agent_from_checkpoint_ns,
    as_int,
    as_list,
    as_str,
    base_info,
    intern_strings,
    json_or,
    tool_result_text,
)
from marft_lg.trajectories.otlp import RawSpan

NAME = "openinference"


def detect(attrs: dict[str, Any]) -> bool:
    return "openinference.span.kind" in attrs


def parse(raw: RawSpan) -> SpanInfo:
    """The span's `SpanInfo`, its repeated strings interned (`base.intern_strings`): a span without error in one
    pass (`_parse` + `intern_strings`, with the fields set once), any other through `_parse`."""
    if raw.error:
        return intern_strings(_parse(raw))
    return _usual(raw, raw.attributes)


def _parse_usual(raw: RawSpan, a: dict[str, Any]) -> SpanInfo:
    """`_parse` + `intern_strings` for a span without error; the C module's `oi_usual` does the same, when built
    (`_use_c`)."""
    get = a.get
    intern = sys.intern
    kind = str(get(_KIND, "")).upper()
    meta, node, agent, step, triggers, task, session, scenario = _meta(get("metadata"))  # strings interned
    session = get(_SESSION) or session
    if type(session) is str:
        session = intern(session)
    name = intern(raw.name)
    if kind == "LLM":
        messages, out = _io(a)
        if out:
            completion = str(out[-1].get("content") or "")
            tool_calls = out[-1].get("tool_calls") or None
        else:
            completion, tool_calls = "", None
        info = SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME, LLM,
                        False, None, agent, None, session, scenario, step, triggers, task, messages, completion, tool_calls)
        info.input_tokens = as_int(get(_PROMPT_TOKENS))
        info.output_tokens = as_int(get(_COMPLETION_TOKENS))
        model = get(_MODEL)
        info.model = intern(model) if type(model) is str else model
        return info
    if kind == "TOOL":
        info = SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME, TOOL,
                        False, None, agent, None, session, scenario, step, triggers, task)
        tool_name = get(_TOOL_NAME) or name
        info.tool_name = intern(tool_name) if type(tool_name) is str else tool_name
        info.tool_call_id = get(_TOOL_CALL_ID)
        info.tool_args = json_or(get(_TOOL_PARAMETERS, get(_INPUT_VALUE)))
        info.tool_result = tool_result_text(get(_OUTPUT_VALUE))
        return info
    if kind == "AGENT" or (kind == "CHAIN" and node and name == node):
        return SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME, AGENT,
                        False, None, agent or name, None, session, scenario, step, triggers, task)
    if kind == "CHAIN" and raw.parent_id is None:
        info = SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME,
                        WORKFLOW, False, None, agent, None, session, scenario, step, triggers, task)
        info.outcome = get(_OUTPUT_VALUE)
        info.metadata = _workflow_metadata(meta)
        return info
    return SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME, OTHER,
                    False, None, None if kind == "CHAIN" and name != node else agent, None, session, scenario, step,
                    triggers, task)


_KIND, _SESSION, _MODEL = "openinference.span.kind", "session.id", "llm.model_name"
_PROMPT_TOKENS, _COMPLETION_TOKENS = "llm.token_count.prompt", "llm.token_count.completion"
_TOOL_NAME, _TOOL_CALL_ID, _TOOL_PARAMETERS = "tool.name", "tool_call.id", "tool.parameters"
_INPUT_VALUE, _OUTPUT_VALUE = "input.value", "output.value"


def _parse(raw: RawSpan) -> SpanInfo:
    a = raw.attributes
    info = base_info(raw, NAME)
    kind = str(a.get("openinference.span.kind", "")).upper()
    meta, node, info.agent, info.step, info.triggers, info.task, session, info.scenario_id = _meta(a.get("metadata"))
    info.session = a.get("session.id") or session
    if kind == "LLM":
        info.kind = LLM
        info.messages, out = _io(a)
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
        info.metadata = _workflow_metadata(meta)
    else:
        info.agent = None if kind == "CHAIN" and raw.name != node else info.agent
    return info


def _workflow_metadata(meta: dict[str, Any]) -> dict[str, Any] | None:
    """The user's metadata of a run: the `metadata` JSON without LangGraph's and LangSmith's own keys."""
    return {k: v for k, v in meta.items() if not k.startswith(("langgraph_", "ls_", "checkpoint"))} or None


_MetaFields = tuple[dict[str, Any], Any, Any, int | None, list[str] | None, Any, Any, Any]
_meta_cache: dict[str, _MetaFields] = {}
_META_CACHE_SIZE = 4096


def _metadata(value: Any) -> _MetaFields:
    """(metadata dict, node, agent, step, triggers, task, session, scenario) from the `metadata` attribute. The
    spans of one node run carry the same JSON text, so each distinct text is parsed once (the results are shared,
    never mutated)."""
    if type(value) is str:
        hit = _meta_cache.get(value)
        if hit is not None:
            return hit
    meta = json_or(value, {})
    meta = meta if isinstance(meta, dict) else {}
    node = as_str(meta.get("langgraph_node"))
    ns = as_str(meta.get("langgraph_checkpoint_ns") or meta.get("checkpoint_ns"))  # a task id: str, hashable
    out = (meta, node, _interned(agent_from_checkpoint_ns(ns, node)), as_int(meta.get("langgraph_step")),
           as_list(meta.get("langgraph_triggers")), _interned(ns),
           _interned(meta.get("thread_id") or meta.get("session_id") or meta.get("conversation_id")),
           _interned(meta.get("scenario_id")))
    if type(value) is str:
        if len(_meta_cache) >= _META_CACHE_SIZE:
            _meta_cache.clear()
        _meta_cache[value] = out
    return out


def _c_metadata() -> Callable[[Any], _MetaFields]:
    """`_metadata` in C (`_otlp_c.oi_metadata`, the same cache and helpers) when built, else `_metadata`."""
    c = otlp.C_READER
    if c is None:
        return _metadata
    keys = ("langgraph_node", "langgraph_checkpoint_ns", "checkpoint_ns", "langgraph_step", "langgraph_triggers",
            "thread_id", "session_id", "conversation_id", "scenario_id")  # the order of _otlp_c.c's MK_*
    c.configure_oi_metadata(_meta_cache, _META_CACHE_SIZE, tuple(map(sys.intern, keys)), (json_or, as_int, as_list))
    return c.oi_metadata


_meta = _c_metadata()


def _interned(value: Any) -> Any:
    return sys.intern(value) if type(value) is str else value


_IN, _OUT = "llm.input_messages.", "llm.output_messages."


def io_messages(a: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`flat_messages` of the input and of the output side. LLM spans of one app repeat a few key sets: each set's
    layout is worked out once (`_layout`), then the messages are built from it without looking at other keys."""
    keys = tuple(a)
    layout = _layouts.get(keys, _UNSEEN)
    if layout is _UNSEEN:
        if len(_layouts) >= _KEY_CACHE_SIZE:
            _layouts.clear()
        layout = _layouts[keys] = _layout(keys)
    if layout is None:
        return _scan_messages(a)
    return _build(a, layout[0]), _build(a, layout[1])


def _build(a: dict[str, Any], specs: list[_MessageSpec]) -> list[dict[str, Any]]:
    """`_message` of each spec, inlined: one LLM span builds a few messages, each nearly always a role and a content."""
    out = []
    for role, content, others in specs:
        msg = {"role": "user" if role is None else a[role], "content": "" if content is None else str(a[content])}
        for plan, key in others:
            value = a[key]
            if plan is None:
                continue
            t_idx, t_attr = plan
            if t_idx < 0:
                msg["tool_call_id"] = value
                continue
            calls = msg.setdefault("tool_calls", [])
            while len(calls) <= t_idx:
                calls.append({"id": None, "name": None, "args": None})
            if t_attr is not None:
                calls[t_idx][t_attr] = json_or(value) if t_attr == "args" else value
        out.append(msg)
    return out


_FieldPlan = tuple[int, str | None] | None  # (-1, _) tool_call_id; (N, attr or None) tool call N; None: nothing
_MessageSpec = tuple[str | None, str | None, tuple[tuple[_FieldPlan, str], ...]]  # role key, content key, other fields
_TOOL_CALL_ATTRS = {"tool_call.id": "id", "tool_call.function.name": "name", "tool_call.function.arguments": "args"}


def _field_plan(field: str) -> _FieldPlan:
    """What `_set_field` does with a field other than role, content and content parts (which `_layout` excludes)."""
    if field == "tool_call_id":
        return -1, None
    if field.startswith("tool_calls."):
        t_idx, _, t_field = field[len("tool_calls."):].partition(".")
        if t_idx.isdigit():
            return int(t_idx), _TOOL_CALL_ATTRS.get(t_field)
    return None
_layouts: dict[tuple[str, ...], tuple[list[_MessageSpec], list[_MessageSpec]] | None] = {}


def _layout(keys: tuple[str, ...]) -> tuple[list[_MessageSpec], list[_MessageSpec]] | None:
    """Per side, per message (in index order): which key holds its role, its content and its other fields (in key
    order). None when building messages in key order could differ: a field given twice, or content parts."""
    fields: list[dict[int, dict[str, str]]] = [{}, {}]
    for key in keys:
        where = _key_cache.get(key, _UNSEEN)
        if where is _UNSEEN:
            where = _message_key(key)
        if where is None:
            continue
        output, idx, field = where
        msg = fields[output].setdefault(idx, {})
        if field in msg or field.startswith("contents."):
            return None
        msg[field] = key
    return tuple([(m.get("role"), m.get("content"),
                   tuple((_field_plan(f), k) for f, k in m.items() if f not in ("role", "content")))
                  for _, m in sorted(side.items())] for side in fields)


def _message(a: dict[str, Any], role: str | None, content: str | None, others: tuple[tuple[str, str], ...]) -> dict[str, Any]:
    msg = {"role": "user" if role is None else a[role], "content": "" if content is None else str(a[content])}
    for field, key in others:
        _set_field(msg, field, a[key])
    return msg


def _scan_messages(a: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`io_messages` in one pass over all the attributes, in key order."""
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


def flat_messages(a: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """`llm.input_messages.N.message.{role,content,tool_call_id,tool_calls.M.tool_call.*,contents.K...}` -> chat messages."""
    by_index: dict[int, dict[str, Any]] = {}
    n = len(prefix)
    for key, value in a.items():
        if key.startswith(prefix):
            _add_field(by_index, key[n:], value)
    return [by_index[i] for i in sorted(by_index)]


def _index_and_field(key: str) -> tuple[int, str] | None:
    """`N.message.<field>` -> (N, field); None for anything else."""
    idx, _, rest = key.partition(".")
    if not idx.isdigit() or not rest.startswith("message."):
        return None
    return int(idx), rest[len("message."):]


def _add_field(by_index: dict[int, dict[str, Any]], key: str, value: Any) -> None:
    """One `N.message.<field>` attribute into message N."""
    parsed = _index_and_field(key)
    if parsed is None:
        return
    _put(by_index, *parsed, value)


def _put(by_index: dict[int, dict[str, Any]], idx: int, field: str, value: Any) -> None:
    """Set `field` of message `idx`, creating the message on its first field."""
    msg = by_index.get(idx)
    if msg is None:
        msg = by_index[idx] = {"role": "user", "content": ""}
    if field == "role":
        msg["role"] = value
    elif field == "content":
        msg["content"] = str(value)
    else:
        _set_field(msg, field, value)


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


def _c_io_messages() -> Callable[[dict[str, Any]], tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """`io_messages` in C (`_otlp_c.oi_io_messages`: `_build` for a key set whose layout is known, this module's
    `io_messages` for the others) when built, else `io_messages`."""
    c = otlp.C_READER
    if c is None:
        return io_messages
    c.configure_oi_messages(_layouts, io_messages, json_or)
    return c.oi_io_messages


_io = _c_io_messages()


def _use_c() -> Callable[[RawSpan, dict[str, Any]], SpanInfo]:
    """The C version of `_parse_usual` (configured with this module's keys, helpers and constants), else this one."""
    if not C_SPAN_INFO:
        return _parse_usual
    keys = (_KIND, "metadata", _SESSION, _MODEL, _PROMPT_TOKENS, _COMPLETION_TOKENS, _TOOL_NAME, _TOOL_CALL_ID,
            _TOOL_PARAMETERS, _INPUT_VALUE, _OUTPUT_VALUE)  # the order of _otlp_c.c's OK_*
    c = otlp.C_READER
    c.configure_oi(tuple(map(sys.intern, keys)),
                   (_meta, _io, as_int, json_or, tool_result_text, _workflow_metadata),
                   (NAME, LLM, TOOL, AGENT, WORKFLOW, OTHER, "LLM", "TOOL", "AGENT", "CHAIN", "content", "tool_calls", ""))
    return c.oi_usual


_usual = _use_c()
