"""OpenLLMetry / traceloop (`opentelemetry-instrumentation-langchain`), declared for the engine
(`formats/engine.py`): the GenAI rules plus the LangGraph context under `traceloop.association.properties.*`."""

from __future__ import annotations

import json
from typing import Any

from marft_lg.tracing import attributes as A
from marft_lg.tracing.attributes import agent_from_namespace
from marft_lg.trajectories.formats import genai
from marft_lg.trajectories.formats.base import (
    AGENT,
    LLM,
    OTHER,
    TOOL,
    WORKFLOW,
    SpanInfo,
    as_int,
    as_list,
    json_or,
    tool_result_text,
)
from marft_lg.trajectories.formats.engine import SPAN_NAME, Attr, Derive, Format, Kind, as_name, interned

NAME = "openllmetry"
PROPS = "traceloop.association.properties."
_SPAN_KIND = "traceloop.span.kind"


def _legacy_llm(info: SpanInfo, a: dict[str, Any], kind: str) -> str:
    """Older releases write no operation name on LLM calls, only `gen_ai.prompt.N.*`."""
    if A.GEN_AI_OPERATION_NAME not in a and any(k.startswith("gen_ai.prompt.") for k in a):
        return LLM
    return kind


def _io(info: SpanInfo, a: dict[str, Any], ctx: Any) -> tuple[Any, ...]:
    """(raw_io, messages, completion, tool_calls): the GenAI rules, or the legacy indexed prompt."""
    if A.GEN_AI_OPERATION_NAME in a:
        return genai.io(info, a)
    completion, calls = genai.output_message(a)
    return None, genai.indexed_messages(a, "gen_ai.prompt."), completion, calls


def _agent(info: SpanInfo, a: dict[str, Any], ctx: Any) -> tuple[Any]:
    return (interned(agent_from_namespace(info.task, info.node)),)


def _tool_args(info: SpanInfo, a: dict[str, Any], ctx: Any) -> tuple[Any]:
    """The GenAI arguments, else LangChain's tool input as traceloop records it (`{"input_str": ...}` unwrapped)."""
    args = json_or(a.get(A.GEN_AI_TOOL_CALL_ARGUMENTS))
    if args is None:
        args = json_or(a.get("traceloop.entity.input"))
    return (args["input_str"] if isinstance(args, dict) and "input_str" in args else args,)


def _outcome(value: Any) -> str | None:
    """The workflow's output as text (a graph's `{"outputs": ...}` unwrapped)."""
    out = json_or(value)
    if isinstance(out, dict) and "outputs" in out:
        out = out["outputs"]
    return None if out is None else out if isinstance(out, str) else json.dumps(out, ensure_ascii=False, default=str)


def _task_names_its_node(info: SpanInfo, a: dict[str, Any]) -> None:
    """A LangGraph node run (`execute_task <node>`) is that node's agent; a helper task inside it (a router) is no
    agent. A workflow-kind span that is no call is the workflow."""
    span_kind = a.get(_SPAN_KIND)
    if info.kind == AGENT and span_kind == "task" and a.get("gen_ai.task.name") != info.node:
        info.agent = None
    if info.kind in (AGENT, OTHER) and span_kind == "workflow":
        info.kind = WORKFLOW


FORMAT = Format(
    NAME,
    detect=lambda a: any(k.startswith("traceloop.") for k in a),
    fields=(Attr("node", PROPS + "langgraph_node", as_name),
            Attr("task", (PROPS + "langgraph_checkpoint_ns", PROPS + "checkpoint_ns"), as_name),
            Derive(("agent",), _agent),
            Attr("step", PROPS + "langgraph_step", as_int),
            Attr("triggers", PROPS + "langgraph_triggers", as_list),
            Attr("session", (PROPS + "thread_id", PROPS + "session_id", PROPS + "conversation_id",
                             A.GEN_AI_CONVERSATION_ID), interned),
            Attr("scenario_id", PROPS + "scenario_id", as_name)),
    kind=Kind(A.GEN_AI_OPERATION_NAME, genai.OPERATION_KINDS, rule=_legacy_llm),
    by_kind={LLM: (Derive(("raw_io", "messages", "completion", "tool_calls"), _io), *genai.USAGE,
                   Attr("agent", A.GEN_AI_AGENT_NAME, as_name, mode="fill")),
             TOOL: (Attr("tool_name", (A.GEN_AI_TOOL_NAME, "traceloop.entity.name", SPAN_NAME), as_name),
                    Attr("tool_call_id", A.GEN_AI_TOOL_CALL_ID),
                    Derive(("tool_args",), _tool_args),
                    Attr("tool_result", (A.GEN_AI_TOOL_CALL_RESULT, "traceloop.entity.output"), tool_result_text,
                         pick="not_none")),
             AGENT: (Attr("agent", (A.GEN_AI_AGENT_NAME, SPAN_NAME), as_name),)},
    refine=(_task_names_its_node,),
    final={WORKFLOW: (Attr("outcome", ("gen_ai.task.output", "traceloop.entity.output"), _outcome, pick="present"),)},
)
