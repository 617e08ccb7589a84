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
    info = base_info(raw, NAME)
    info.episode_id = _str(a.get(A.MARFT_EPISODE_ID))
    info.scenario_id = _str(a.get(A.MARFT_SCENARIO_ID))
    if raw.name == A.FEEDBACK_SPAN_NAME or A.MARFT_FEEDBACK_NAME in a:
        info.kind = FEEDBACK
        info.feedback_name = _str(a.get(A.MARFT_FEEDBACK_NAME))
        info.feedback_value = a.get(A.MARFT_FEEDBACK_VALUE)
        return info
    info.agent = _str(a.get(A.MARFT_AGENT_ROLE)) or _str(a.get(A.MARFT_AGENT_NODE))
    info.step = as_int(a.get(A.MARFT_LANGGRAPH_STEP))
    info.triggers = as_list(a.get(A.MARFT_LANGGRAPH_TRIGGERS))
    info.task = _str(a.get(A.MARFT_LANGGRAPH_TASK_ID)) or _str(a.get(A.MARFT_LANGGRAPH_CHECKPOINT_NS))
    agent = info.agent
    genai.fill(info, a)
    info.agent = agent or info.agent
    if info.kind == LLM:
        info.prompt_token_ids = a.get(A.MARFT_PROMPT_TOKEN_IDS)
        info.completion_token_ids = a.get(A.MARFT_COMPLETION_TOKEN_IDS)
        info.completion_logprobs = a.get(A.MARFT_COMPLETION_LOGPROBS)
        info.adapter_version = _str(a.get(A.MARFT_ADAPTER_VERSION))
        latency = a.get(A.MARFT_LATENCY_S)
        info.latency_s = float(latency) if isinstance(latency, int | float) else None
        calls = json_or(a.get(A.MARFT_TOOL_CALLS))
        if isinstance(calls, list) and calls:
            info.tool_calls = calls
    elif info.kind == TOOL and info.error and not info.error_message:
        info.error_message = _str(a.get(A.ERROR_TYPE))
    if info.kind == WORKFLOW or A.MARFT_OUTCOME in a or A.MARFT_EPISODE_METADATA in a:
        info.outcome = _str(a.get(A.MARFT_OUTCOME)) if A.MARFT_OUTCOME in a else info.outcome
        meta = json_or(a.get(A.MARFT_EPISODE_METADATA))
        info.metadata = meta if isinstance(meta, dict) else info.metadata
        if info.kind != LLM and info.kind != TOOL and raw.parent_id is None:
            info.kind = WORKFLOW
    return info


def _str(value: Any) -> str | None:
    return None if value is None else str(value)
