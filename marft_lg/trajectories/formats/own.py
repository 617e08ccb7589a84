"""marft_lg's own spans (`marft.*` next to GenAI semconv; see marft_lg/tracing/attributes.py)."""

from __future__ import annotations

from typing import Any

from marft_lg.tracing import attributes as A
from marft_lg.trajectories.formats import genai
from marft_lg.trajectories.formats.base import (
    FEEDBACK,
    LLM,
    TOOL,
    WORKFLOW,
    SpanInfo,
    as_int,
    as_list,
    base_info,
    json_or,
)
from marft_lg.trajectories.otlp import RawSpan

NAME = "own"


def detect(attrs: dict[str, Any]) -> bool:
    return A.MARFT_EPISODE_ID in attrs or A.MARFT_AGENT_ROLE in attrs or A.MARFT_FEEDBACK_NAME in attrs


def parse(raw: RawSpan) -> SpanInfo:
    a = raw.attributes
    get = a.get
    info = base_info(raw, NAME)
    v = get(_EPISODE_ID)  # strings nearly always: `_str` inlined on the hot lines
    info.episode_id = v if v is None or type(v) is str else str(v)
    v = get(_SCENARIO_ID)
    info.scenario_id = v if v is None or type(v) is str else str(v)
    if raw.name == _FEEDBACK_SPAN or _FEEDBACK_NAME in a:
        info.kind = FEEDBACK
        info.feedback_name = _str(get(_FEEDBACK_NAME))
        info.feedback_value = get(_FEEDBACK_VALUE)
        return info
    agent = get(_ROLE)
    agent = (agent if type(agent) is str else _str(agent)) or _str(get(_NODE))
    info.agent = agent
    step = get(_STEP)
    info.step = step if type(step) is int else as_int(step)
    triggers = get(_TRIGGERS)
    info.triggers = None if triggers is None else as_list(triggers)
    v = get(_TASK_ID)
    info.task = (v if type(v) is str else _str(v)) or _str(get(_CHECKPOINT_NS))
    genai.fill(info, a)
    info.agent = agent or info.agent
    kind = info.kind
    if kind == LLM:
        info.prompt_token_ids = get(_PROMPT_TOKEN_IDS)
        info.completion_token_ids = get(_COMPLETION_TOKEN_IDS)
        info.completion_logprobs = get(_COMPLETION_LOGPROBS)
        info.adapter_version = _str(get(_ADAPTER_VERSION))
        latency = get(_LATENCY_S)
        info.latency_s = float(latency) if isinstance(latency, int | float) else None
        calls = get(_TOOL_CALLS)
        if calls is not None:
            calls = json_or(calls)
            if isinstance(calls, list) and calls:
                info.tool_calls = calls
    elif kind == TOOL and info.error and not info.error_message:
        info.error_message = _str(get(A.ERROR_TYPE))
    if kind == WORKFLOW or _OUTCOME in a or _EPISODE_METADATA in a:
        info.outcome = _str(get(_OUTCOME)) if _OUTCOME in a else info.outcome
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


def _str(value: Any) -> str | None:
    return value if value is None or type(value) is str else str(value)
