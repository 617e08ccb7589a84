"""marft_lg's own spans (`marft.*` next to GenAI semconv; see marft_lg/tracing/attributes.py)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from marft_lg.tracing import attributes as A
from marft_lg.trajectories import otlp
from marft_lg.trajectories.formats import genai
from marft_lg.trajectories.formats.base import (
    AGENT,
    C_SPAN_INFO,
    FEEDBACK,
    LLM,
    OTHER,
    TOOL,
    WORKFLOW,
    SpanInfo,
    as_int,
    as_list,
    as_str,
    base_info,
    intern_strings,
    json_or,
)
from marft_lg.trajectories.otlp import RawSpan

NAME = "own"


def detect(attrs: dict[str, Any]) -> bool:
    return _EPISODE_ID in attrs or _ROLE in attrs or _FEEDBACK_NAME in attrs


def parse(raw: RawSpan) -> SpanInfo:
    """The span's `SpanInfo`, its repeated strings interned (`base.intern_strings`). The usual spans (no error, no
    feedback, one of the four GenAI operations marft_lg writes) are read in one pass (`_parse_usual`)."""
    a = raw.attributes
    op = a.get(_OP)
    if raw.error or type(op) is not str or raw.name == _FEEDBACK_SPAN or _FEEDBACK_NAME in a:
        return intern_strings(_parse(raw))
    return _usual(raw, a, op)


def _parse_usual(raw: RawSpan, a: dict[str, Any], op: str) -> SpanInfo:
    """`_parse` + `intern_strings` (with `genai.fill` inlined) for a span without error or feedback; the C module's
    `own_usual` does the same, when built (`_use_c`)."""
    get = a.get
    intern = sys.intern
    name = intern(raw.name)
    v = get(_EPISODE_ID)
    episode_id = None if v is None else intern(v if type(v) is str else str(v))
    v = get(_SCENARIO_ID)
    scenario_id = None if v is None else intern(v if type(v) is str else str(v))
    agent = get(_ROLE)
    agent = (agent if type(agent) is str else as_str(agent)) or as_str(get(_NODE))
    step = get(_STEP)
    if type(step) is not int:
        step = as_int(step)
    triggers = get(_TRIGGERS)
    if triggers is not None:
        triggers = as_list(triggers)
    v = get(_TASK_ID)
    task = (v if type(v) is str else as_str(v)) or as_str(get(_CHECKPOINT_NS))
    if type(task) is str:
        task = intern(task)
    session = get(_CONVERSATION)
    if type(session) is str:
        session = intern(session)
    if op in genai.LLM_OPERATIONS:
        agent = agent or get(_AGENT_NAME)
        info = SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME, LLM,
                        False, None, intern(agent) if type(agent) is str else agent, episode_id, session, scenario_id,
                        step, triggers, task)
        if _INPUT_MESSAGES in a or _OUTPUT_MESSAGES in a:
            info.raw_io = (get(_INPUT_MESSAGES), get(_SYSTEM_INSTRUCTIONS), get(_OUTPUT_MESSAGES))
        else:
            info.messages = genai.input_messages(a)
            info.completion, info.tool_calls = genai.output_message(a)
        v = get(_INPUT_TOKENS, _MISSING)
        info.input_tokens = v if type(v) is int else as_int(get(_PROMPT_TOKENS) if v is _MISSING else v)
        v = get(_OUTPUT_TOKENS, _MISSING)
        info.output_tokens = v if type(v) is int else as_int(get(_COMPLETION_TOKENS) if v is _MISSING else v)
        model = get(_RESPONSE_MODEL) or get(_REQUEST_MODEL)
        if model is not None and model != "unknown":
            info.model = intern(str(model))
        info.prompt_token_ids = get(_PROMPT_TOKEN_IDS)
        info.completion_token_ids = get(_COMPLETION_TOKEN_IDS)
        info.completion_logprobs = get(_COMPLETION_LOGPROBS)
        v = get(_ADAPTER_VERSION)
        if v is not None:
            info.adapter_version = intern(v if type(v) is str else str(v))
        latency = get(_LATENCY_S)
        if isinstance(latency, int | float):
            info.latency_s = float(latency)
        calls = get(_TOOL_CALLS)
        if calls is not None:
            calls = json_or(calls)
            if isinstance(calls, list) and calls:
                info.tool_calls = calls
        kind = LLM
    else:
        if op == _OP_TOOL:
            kind = TOOL
        elif op in _AGENT_OPS:
            kind = AGENT
            agent = agent or get(_AGENT_NAME) or name
        elif op == _OP_WORKFLOW:
            kind = WORKFLOW
        else:
            kind = OTHER
        info = SpanInfo(raw.trace_id, raw.span_id, raw.parent_id, name, raw.start_ns, raw.end_ns, raw.source, NAME, kind,
                        False, None, intern(agent) if type(agent) is str else agent, episode_id, session, scenario_id,
                        step, triggers, task)
        if kind == TOOL:
            tool_name = get(_TOOL_NAME) or name
            info.tool_name = intern(tool_name) if type(tool_name) is str else tool_name
            info.tool_call_id = get(_TOOL_CALL_ID)
            info.tool_args = json_or(get(_TOOL_ARGS))
            info.tool_result = get(_TOOL_RESULT)
    if kind == WORKFLOW or _OUTCOME in a or _EPISODE_METADATA in a:
        if _OUTCOME in a:
            info.outcome = as_str(get(_OUTCOME))
        meta = json_or(get(_EPISODE_METADATA))
        if isinstance(meta, dict):
            info.metadata = meta
        if kind != LLM and kind != TOOL and raw.parent_id is None:
            info.kind = WORKFLOW
    return info


def _parse(raw: RawSpan) -> SpanInfo:
    a = raw.attributes
    get = a.get
    info = base_info(raw, NAME)
    v = get(_EPISODE_ID)  # strings nearly always: `_str` inlined on the hot lines
    info.episode_id = v if v is None or type(v) is str else str(v)
    v = get(_SCENARIO_ID)
    info.scenario_id = v if v is None or type(v) is str else str(v)
    if raw.name == _FEEDBACK_SPAN or _FEEDBACK_NAME in a:
        info.kind = FEEDBACK
        info.feedback_name = as_str(get(_FEEDBACK_NAME))
        info.feedback_value = get(_FEEDBACK_VALUE)
        return info
    agent = get(_ROLE)
    agent = (agent if type(agent) is str else as_str(agent)) or as_str(get(_NODE))
    info.agent = agent
    step = get(_STEP)
    info.step = step if type(step) is int else as_int(step)
    triggers = get(_TRIGGERS)
    info.triggers = None if triggers is None else as_list(triggers)
    v = get(_TASK_ID)
    info.task = (v if type(v) is str else as_str(v)) or as_str(get(_CHECKPOINT_NS))
    genai.fill(info, a)
    info.agent = agent or info.agent
    kind = info.kind
    if kind == LLM:
        info.prompt_token_ids = get(_PROMPT_TOKEN_IDS)
        info.completion_token_ids = get(_COMPLETION_TOKEN_IDS)
        info.completion_logprobs = get(_COMPLETION_LOGPROBS)
        info.adapter_version = as_str(get(_ADAPTER_VERSION))
        latency = get(_LATENCY_S)
        info.latency_s = float(latency) if isinstance(latency, int | float) else None
        calls = get(_TOOL_CALLS)
        if calls is not None:
            calls = json_or(calls)
            if isinstance(calls, list) and calls:
                info.tool_calls = calls
    elif kind == TOOL and info.error and not info.error_message:
        info.error_message = as_str(get(A.ERROR_TYPE))
    if kind == WORKFLOW or _OUTCOME in a or _EPISODE_METADATA in a:
        info.outcome = as_str(get(_OUTCOME)) if _OUTCOME in a else info.outcome
        meta = json_or(get(_EPISODE_METADATA))
        info.metadata = meta if isinstance(meta, dict) else info.metadata
        if kind != LLM and kind != TOOL and raw.parent_id is None:
            info.kind = WORKFLOW
    return info


_EPISODE_ID, _SCENARIO_ID, _ROLE, _NODE = A.MARFT_EPISODE_ID, A.MARFT_SCENARIO_ID, A.MARFT_AGENT_ROLE, A.MARFT_AGENT_NODE
_FEEDBACK_SPAN, _FEEDBACK_NAME, _FEEDBACK_VALUE = A.FEEDBACK_SPAN_NAME, A.MARFT_FEEDBACK_NAME, A.MARFT_FEEDBACK_VALUE
_STEP, _TRIGGERS = A.MARFT_LANGGRAPH_STEP, A.MARFT_LANGGRAPH_TRIGGERS
_TASK_ID, _CHECKPOINT_NS = A.MARFT_LANGGRAPH_TASK_ID, A.MARFT_LANGGRAPH_CHECKPOINT_NS
_PROMPT_TOKEN_IDS, _COMPLETION_TOKEN_IDS = A.MARFT_PROMPT_TOKEN_IDS, A.MARFT_COMPLETION_TOKEN_IDS
_COMPLETION_LOGPROBS, _ADAPTER_VERSION, _LATENCY_S = A.MARFT_COMPLETION_LOGPROBS, A.MARFT_ADAPTER_VERSION, A.MARFT_LATENCY_S
_TOOL_CALLS, _OUTCOME, _EPISODE_METADATA = A.MARFT_TOOL_CALLS, A.MARFT_OUTCOME, A.MARFT_EPISODE_METADATA
_OP, _CONVERSATION, _AGENT_NAME = "gen_ai.operation.name", "gen_ai.conversation.id", "gen_ai.agent.name"
_OP_TOOL, _AGENT_OPS, _OP_WORKFLOW = "execute_tool", ("invoke_agent", "create_agent"), "invoke_workflow"
_INPUT_MESSAGES, _OUTPUT_MESSAGES = "gen_ai.input.messages", "gen_ai.output.messages"
_SYSTEM_INSTRUCTIONS = "gen_ai.system_instructions"
_INPUT_TOKENS, _PROMPT_TOKENS = "gen_ai.usage.input_tokens", "gen_ai.usage.prompt_tokens"
_OUTPUT_TOKENS, _COMPLETION_TOKENS = "gen_ai.usage.output_tokens", "gen_ai.usage.completion_tokens"
_RESPONSE_MODEL, _REQUEST_MODEL = "gen_ai.response.model", "gen_ai.request.model"
_TOOL_NAME, _TOOL_CALL_ID = "gen_ai.tool.name", "gen_ai.tool.call.id"
_TOOL_ARGS, _TOOL_RESULT = "gen_ai.tool.call.arguments", "gen_ai.tool.call.result"
_MISSING = object()


def _use_c() -> Callable[[RawSpan, dict[str, Any], str], SpanInfo]:
    """The C version of `_parse_usual` (configured with this module's keys, helpers and constants), else this one."""
    if not C_SPAN_INFO:
        return _parse_usual
    keys = (_EPISODE_ID, _SCENARIO_ID, _ROLE, _NODE, _STEP, _TRIGGERS, _TASK_ID, _CHECKPOINT_NS, _CONVERSATION,
            _AGENT_NAME, _INPUT_MESSAGES, _SYSTEM_INSTRUCTIONS, _OUTPUT_MESSAGES, _INPUT_TOKENS, _PROMPT_TOKENS,
            _OUTPUT_TOKENS, _COMPLETION_TOKENS, _RESPONSE_MODEL, _REQUEST_MODEL, _PROMPT_TOKEN_IDS,
            _COMPLETION_TOKEN_IDS, _COMPLETION_LOGPROBS, _ADAPTER_VERSION, _LATENCY_S, _TOOL_CALLS, _TOOL_NAME,
            _TOOL_CALL_ID, _TOOL_ARGS, _TOOL_RESULT, _OUTCOME, _EPISODE_METADATA)  # the order of _otlp_c.c's K_*
    c = otlp.C_READER
    c.configure_own(tuple(map(sys.intern, keys)), (as_int, as_list, json_or, genai.input_messages, genai.output_message),
                    (NAME, LLM, TOOL, AGENT, WORKFLOW, OTHER, _OP_TOOL, _AGENT_OPS, _OP_WORKFLOW,
                     genai.LLM_OPERATIONS, "unknown"))
    return c.own_usual


_usual = _use_c()
