"""marft_lg's own spans (`marft.*` next to GenAI semconv; see marft_lg/tracing/attributes.py), declared for the
engine (`formats/engine.py`): the GenAI rules plus the graph context, token ids and log-probs marft_lg records."""

from __future__ import annotations

from typing import Any

from marft_lg.tracing import attributes as A
from marft_lg.trajectories.formats import genai
from marft_lg.trajectories.formats.base import (
    AGENT,
    FEEDBACK,
    LLM,
    OTHER,
    TOOL,
    WORKFLOW,
    SpanInfo,
    as_int,
    as_list,
    as_str,
    json_or,
)
from marft_lg.trajectories.formats.engine import Attr, Format, Kind, as_name

NAME = "own"


def _feedback_or_operation(info: SpanInfo, a: dict[str, Any], kind: str) -> str:
    """A `record_feedback` span is feedback, whatever else it carries."""
    return FEEDBACK if info.name == A.FEEDBACK_SPAN_NAME or A.MARFT_FEEDBACK_NAME in a else kind


def _latency(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) else None


def _tool_calls(value: Any) -> list[dict[str, Any]] | None:
    """The tool calls parsed from the completion at generation time (they win over the GenAI message's): a
    non-empty JSON list of call objects, else None."""
    calls = json_or(value)
    if isinstance(calls, list) and calls and all(isinstance(c, dict) for c in calls):
        return calls
    return None


def _true(value: Any) -> bool:
    return value is True or value == "true"


def _dict(value: Any) -> dict[str, Any] | None:
    value = json_or(value)
    return value if isinstance(value, dict) else None


def _root_is_workflow(info: SpanInfo, a: dict[str, Any]) -> None:
    """A root span that carries the episode's outcome or metadata is the workflow (not an LLM or tool call)."""
    if info.parent_id is None and info.kind not in (LLM, TOOL, FEEDBACK, WORKFLOW) and (
            A.MARFT_OUTCOME in a or A.MARFT_EPISODE_METADATA in a):
        info.kind = WORKFLOW


_CONTEXT = (Attr("agent", (A.MARFT_AGENT_ROLE, A.MARFT_AGENT_NODE), as_name),
            Attr("step", A.MARFT_LANGGRAPH_STEP, as_int),
            Attr("triggers", A.MARFT_LANGGRAPH_TRIGGERS, as_list),
            Attr("task", (A.MARFT_LANGGRAPH_TASK_ID, A.MARFT_LANGGRAPH_CHECKPOINT_NS), as_name),
            genai.SESSION,
            Attr("outcome", A.MARFT_OUTCOME, as_str),
            Attr("metadata", A.MARFT_EPISODE_METADATA, _dict))
_LLM = (Attr("prompt_token_ids", A.MARFT_PROMPT_TOKEN_IDS),
        Attr("completion_token_ids", A.MARFT_COMPLETION_TOKEN_IDS),
        Attr("completion_logprobs", A.MARFT_COMPLETION_LOGPROBS),
        Attr("adapter_version", A.MARFT_ADAPTER_VERSION, as_name),
        Attr("latency_s", A.MARFT_LATENCY_S, _latency),
        Attr("tool_calls", A.MARFT_TOOL_CALLS, _tool_calls, mode="replace"),
        Attr("served", A.MARFT_SERVED, _true),
        Attr("choice", A.MARFT_CHOICE_INDEX, as_int),
        Attr("constraint", A.MARFT_CONSTRAINT, as_str))

FORMAT = Format(
    NAME,
    detect=lambda a: (A.MARFT_EPISODE_ID in a or A.MARFT_AGENT_ROLE in a or A.MARFT_FEEDBACK_NAME in a
                      or A.MARFT_SERVED in a),
    kind=Kind(A.GEN_AI_OPERATION_NAME, genai.OPERATION_KINDS, rule=_feedback_or_operation),
    fields=(Attr("episode_id", A.MARFT_EPISODE_ID, as_name), Attr("scenario_id", A.MARFT_SCENARIO_ID, as_name)),
    by_kind={FEEDBACK: (Attr("feedback_name", A.MARFT_FEEDBACK_NAME, as_str), Attr("feedback_value", A.MARFT_FEEDBACK_VALUE),
                        Attr("feedback_thread", A.MARFT_FEEDBACK_THREAD_ID, as_str),
                        Attr("feedback_turn", A.MARFT_FEEDBACK_TURN, as_int),
                        Attr("feedback_trace", A.MARFT_FEEDBACK_TRACE_ID, as_str)),
             LLM: (*_CONTEXT, *genai.LLM_FIELDS, *_LLM),
             TOOL: (*_CONTEXT, *genai.TOOL_FIELDS),
             AGENT: (*_CONTEXT, *genai.AGENT_FIELDS),
             WORKFLOW: _CONTEXT,
             OTHER: _CONTEXT},
    refine=(_root_is_workflow,),
)
