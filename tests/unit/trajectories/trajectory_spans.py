"""Build OTLP/JSON spans and lines by hand, following marft_lg/tracing/attributes.py (the own format)
and the OTel GenAI conventions, for mining tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from marft_lg.tracing import attributes as A

T0 = 1_790_000_000_000_000_000  # ns, 2026-09


def value(v: Any) -> dict[str, Any]:
    if isinstance(v, bool):
        return {"boolValue": v}
    if isinstance(v, int):
        return {"intValue": str(v)}
    if isinstance(v, float):
        return {"doubleValue": v}
    if isinstance(v, list | tuple):
        return {"arrayValue": {"values": [value(x) for x in v]}}
    return {"stringValue": str(v)}


def span(trace: int, sid: int, parent: int | None, name: str, start: float, end: float,
         attrs: dict[str, Any] | None = None, *, error: str | None = None) -> dict[str, Any]:
    """A span; ids are small ints turned into hex, times are ms offsets from T0."""
    out: dict[str, Any] = {
        "traceId": f"{trace:032x}",
        "spanId": f"{sid:016x}",
        "parentSpanId": f"{parent:016x}" if parent else "",
        "name": name,
        "kind": 1,
        "startTimeUnixNano": str(T0 + int(start * 1e6)),
        "endTimeUnixNano": str(T0 + int(end * 1e6)),
        "attributes": [{"key": k, "value": value(v)} for k, v in (attrs or {}).items()],
        "status": {"code": 2, "message": error} if error else {"code": 1},
    }
    if error:
        out["events"] = [{"name": "exception", "attributes": [
            {"key": "exception.type", "value": value("ToolException")},
            {"key": "exception.message", "value": value(error)}]}]
    return out


def line(spans: list[dict[str, Any]]) -> str:
    return json.dumps({"resourceSpans": [{"resource": {"attributes": []},
                                          "scopeSpans": [{"scope": {"name": "test"}, "spans": spans}]}]})


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(ln + "\n" for ln in lines))
    return path


def own_episode(trace: int, episode_id: str, *, scenario_id: str = "s1", base: int = 0, t: float = 0.0,
                tool_error: bool = False) -> list[dict[str, Any]]:
    """A two-agent own-format episode: planner chat, then researcher chat that calls `lookup`."""
    wf, ag1, ch1, ag2, ch2, tl = (base + i for i in range(1, 7))
    plan = "TOPICS: refund_policy please"
    return [
        span(trace, wf, None, "invoke_workflow support", t, t + 100, {
            A.GEN_AI_OPERATION_NAME: A.OP_WORKFLOW, A.MARFT_EPISODE_ID: episode_id, A.MARFT_SCENARIO_ID: scenario_id,
            A.MARFT_EPISODE_METADATA: json.dumps({"user": "u1"}), A.MARFT_OUTCOME: json.dumps({"answer": "30 days"})}),
        span(trace, ag1, wf, "invoke_agent planner", t + 1, t + 20, {
            A.GEN_AI_OPERATION_NAME: A.OP_AGENT, A.GEN_AI_AGENT_NAME: "planner", A.MARFT_AGENT_ROLE: "planner",
            A.MARFT_EPISODE_ID: episode_id, A.MARFT_LANGGRAPH_STEP: 1, A.MARFT_LANGGRAPH_TASK_ID: f"{episode_id}-t1"}),
        span(trace, ch1, ag1, "chat planner", t + 2, t + 19, {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT, A.MARFT_AGENT_ROLE: "planner", A.MARFT_EPISODE_ID: episode_id,
            A.MARFT_LANGGRAPH_STEP: 1, A.MARFT_LANGGRAPH_TASK_ID: f"{episode_id}-t1",
            A.GEN_AI_INPUT_MESSAGES: A.to_genai_messages([{"role": "system", "content": "You plan."},
                                                           {"role": "user", "content": "refund?"}]),
            A.GEN_AI_OUTPUT_MESSAGES: A.to_genai_messages([{"role": "assistant", "content": plan}]),
            A.MARFT_PROMPT_TOKEN_IDS: A.encode_ints([1, 2, 3]), A.MARFT_COMPLETION_TOKEN_IDS: A.encode_ints([7, 8]),
            A.MARFT_COMPLETION_LOGPROBS: A.encode_floats([-0.5, -0.25]), A.MARFT_ADAPTER_VERSION: "v3",
            A.GEN_AI_RESPONSE_MODEL: "smollm2", A.GEN_AI_USAGE_INPUT_TOKENS: 3, A.GEN_AI_USAGE_OUTPUT_TOKENS: 2,
            A.MARFT_LATENCY_S: 0.017}),
        span(trace, ag2, wf, "invoke_agent researcher", t + 21, t + 90, {
            A.GEN_AI_OPERATION_NAME: A.OP_AGENT, A.MARFT_AGENT_ROLE: "researcher", A.MARFT_EPISODE_ID: episode_id,
            A.MARFT_LANGGRAPH_STEP: 2, A.MARFT_LANGGRAPH_TASK_ID: f"{episode_id}-t2"}),
        span(trace, ch2, ag2, "chat researcher", t + 22, t + 40, {
            A.GEN_AI_OPERATION_NAME: A.OP_CHAT, A.MARFT_AGENT_ROLE: "researcher", A.MARFT_EPISODE_ID: episode_id,
            A.MARFT_LANGGRAPH_STEP: 2, A.MARFT_LANGGRAPH_TASK_ID: f"{episode_id}-t2",
            A.GEN_AI_INPUT_MESSAGES: A.to_genai_messages([{"role": "user", "content": f"Plan:\n{plan}"}]),
            A.GEN_AI_OUTPUT_MESSAGES: A.to_genai_messages([{"role": "assistant", "content": "",
                                                            "tool_calls": [{"id": "c1", "name": "lookup",
                                                                            "args": {"topic": "refund_policy"}}]}]),
            A.MARFT_ADAPTER_VERSION: "v1"}),
        span(trace, tl, ag2, "execute_tool lookup", t + 41, t + 45, {
            A.GEN_AI_OPERATION_NAME: A.OP_TOOL, A.GEN_AI_TOOL_NAME: "lookup", A.GEN_AI_TOOL_CALL_ID: "c1",
            A.MARFT_EPISODE_ID: episode_id, A.GEN_AI_TOOL_CALL_ARGUMENTS: json.dumps({"topic": "refund_policy"}),
            **({} if tool_error else {A.GEN_AI_TOOL_CALL_RESULT: "30 days"})},
            error="unknown topic" if tool_error else None),
    ]


def feedback_span(trace: int, sid: int, episode_id: str, name: str, val: Any, t: float) -> dict[str, Any]:
    return span(trace, sid, None, A.FEEDBACK_SPAN_NAME, t, t, {
        A.MARFT_EPISODE_ID: episode_id, A.MARFT_FEEDBACK_NAME: name, A.MARFT_FEEDBACK_VALUE: val})
