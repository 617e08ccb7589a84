"""OpenLLMetry / traceloop (`opentelemetry-instrumentation-langchain`): GenAI attributes plus
LangGraph context under `traceloop.association.properties.*`."""

from __future__ import annotations

from typing import Any

from marft_lg.trajectories.formats import genai
from marft_lg.trajectories.formats.base import (
    AGENT,
    TOOL,
    SpanInfo,
    agent_from_checkpoint_ns,
    as_int,
    as_list,
    as_str,
    base_info,
    json_or,
    tool_result_text,
)
from marft_lg.trajectories.otlp import RawSpan

NAME = "openllmetry"
PROPS = "traceloop.association.properties."


def detect(attrs: dict[str, Any]) -> bool:
    return any(k.startswith("traceloop.") for k in attrs)


def parse(raw: RawSpan) -> SpanInfo:
    a = raw.attributes
    info = base_info(raw, NAME)
    node = as_str(a.get(PROPS + "langgraph_node"))
    ns = as_str(a.get(PROPS + "langgraph_checkpoint_ns") or a.get(PROPS + "checkpoint_ns"))  # a task id: hashable
    info.agent = agent_from_checkpoint_ns(ns, node)
    info.step = as_int(a.get(PROPS + "langgraph_step"))
    info.triggers = as_list(a.get(PROPS + "langgraph_triggers"))
    info.task = ns
    info.session = a.get(PROPS + "thread_id") or a.get(PROPS + "session_id") or a.get(PROPS + "conversation_id")
    info.scenario_id = a.get(PROPS + "scenario_id")
    if "gen_ai.operation.name" in a:
        genai.fill(info, a)
    elif any(k.startswith("gen_ai.prompt.") for k in a):  # older releases: no operation name on LLM spans
        info.kind = genai.LLM
        info.messages = genai.indexed_messages(a, "gen_ai.prompt.")
        info.completion, info.tool_calls = genai.output_message(a)
        genai.usage_and_model(info, a)
    if info.kind == TOOL:
        info.tool_name = a.get("gen_ai.tool.name") or a.get("traceloop.entity.name") or info.name
        args = info.tool_args if info.tool_args is not None else json_or(a.get("traceloop.entity.input"))
        if isinstance(args, dict) and "input_str" in args:
            args = args["input_str"]
        info.tool_args = args
        info.tool_result = tool_result_text(info.tool_result if info.tool_result is not None
                                            else a.get("traceloop.entity.output"))
    if info.kind == AGENT and a.get("traceloop.span.kind") == "task":
        # a LangGraph node run (`execute_task <node>`), or a helper inside it such as a router function
        info.agent = info.agent if a.get("gen_ai.task.name") == node else None
    if info.kind in (AGENT, genai.OTHER) and a.get("traceloop.span.kind") == "workflow":
        info.kind = genai.WORKFLOW
    if info.kind == genai.WORKFLOW:
        out = json_or(a.get("gen_ai.task.output", a.get("traceloop.entity.output")))
        if isinstance(out, dict) and "outputs" in out:
            out = out["outputs"]
        info.outcome = None if out is None else out if isinstance(out, str) else _dumps(out)
    return info


def _dumps(value: Any) -> str:
    import json

    return json.dumps(value, ensure_ascii=False, default=str)
