"""Mining joins a server's record of what it sampled to the app's LLM call (by parent span, else by response id);
the server's ids, text, version, tool calls and role win; extra choices are not actions; a server record without
an app call is an action of its own; files and in-memory records give the same tables."""

from __future__ import annotations

import json

from marft_lg.tracing import attributes as A
from marft_lg.tracing.records import KIND_CLIENT, KIND_INTERNAL, KIND_SERVER, SpanRecord
from marft_lg.trajectories.in_memory import raw_spans
from marft_lg.trajectories.mining import mine_spans, mine_with_report


def _app_call(trace: int, parent: int, episode: str, node: str, *, response_id: str | None = None, t: int = 0):
    attrs = {A.GEN_AI_OPERATION_NAME: A.OP_CHAT, A.MARFT_EPISODE_ID: episode, A.MARFT_AGENT_ROLE: node,
             A.GEN_AI_REQUEST_MODEL: node, A.MARFT_LANGGRAPH_STEP: 1,
             A.GEN_AI_INPUT_MESSAGES: A.to_genai_messages([{"role": "user", "content": "hi"}]),
             A.GEN_AI_OUTPUT_MESSAGES: A.to_genai_messages([{"role": "assistant", "content": ""}])}
    if response_id:
        attrs[A.GEN_AI_RESPONSE_ID] = response_id
    span = SpanRecord(trace, parent, f"chat {node}", KIND_CLIENT, attrs)
    span.start_ns, span.end_ns = 1_000 + t, 2_000 + t
    return span


def _served(trace: int, parent: int, role: str, ids: list[int], *, choice: int = 0, episode: str | None = None,
            response_id: str = "chatcmpl-1", end: int = 1_900, text: str = "<tool_call>x</tool_call>"):
    attrs = {A.GEN_AI_OPERATION_NAME: A.OP_CHAT, A.MARFT_SERVED: True, A.MARFT_AGENT_ROLE: role,
             A.MARFT_ADAPTER_VERSION: "v3", A.MARFT_PROMPT_TOKEN_IDS: A.encode_ints([1, 2, 3]),
             A.MARFT_COMPLETION_TOKEN_IDS: A.encode_ints(ids), A.MARFT_COMPLETION_LOGPROBS: A.encode_floats([-1.0] * len(ids)),
             A.GEN_AI_RESPONSE_ID: response_id, A.MARFT_CHOICE_INDEX: choice, A.GEN_AI_RESPONSE_MODEL: "base",
             A.MARFT_TOOL_CALLS: json.dumps([{"id": "c1", "name": "nope", "args": {}, "error": "unknown tool 'nope'"}]),
             A.GEN_AI_INPUT_MESSAGES: A.to_genai_messages([{"role": "user", "content": "hi"}]),
             A.GEN_AI_OUTPUT_MESSAGES: A.to_genai_messages([{"role": "assistant", "content": text}])}
    if episode:
        attrs[A.MARFT_EPISODE_ID] = episode
    span = SpanRecord(trace, parent, "chat writer", KIND_SERVER, attrs)
    span.start_ns, span.end_ns = 1_100, end
    return span


def _root(trace: int, episode: str):
    span = SpanRecord(trace, 0, "invoke_workflow LangGraph", KIND_INTERNAL,
                      {A.GEN_AI_OPERATION_NAME: A.OP_WORKFLOW, A.MARFT_EPISODE_ID: episode})
    span.start_ns, span.end_ns = 0, 10_000
    return span


def test_the_servers_record_is_folded_into_the_call_it_answered():
    root = _root(1, "ep")
    call = _app_call(1, root.span_id, "ep", "drafter")
    retried = _served(1, call.span_id, "writer", [7, 7], end=1_500)  # an earlier attempt of the same request
    answer = _served(1, call.span_id, "writer", [8, 9], end=1_900)
    second_choice = _served(1, call.span_id, "writer", [5], choice=1, end=1_950)
    ds, report = mine_with_report(raw_spans([root, call, retried, answer, second_choice]))
    [row] = ds.actions.to_dict("records")
    assert list(row["completion_token_ids"]) == [8, 9] and list(row["prompt_token_ids"]) == [1, 2, 3]
    assert row["adapter_version"] == "v3" and row["agent"] == "writer"  # the role whose adapter answered
    assert row["completion"] == "<tool_call>x</tool_call>" and row["tool_errors"] == 1
    assert row["span_id"] == f"{call.span_id:016x}"  # the app's call, in its place in the graph
    assert report.served_merged == 2 and report.actions_without_token_ids == {}


def test_a_record_joins_by_response_id_and_one_without_a_call_is_an_action():
    root = _root(1, "ep")
    call = _app_call(1, root.span_id, "ep", "writer", response_id="chatcmpl-42")
    elsewhere = _served(99, 0xBEEF, "writer", [4], response_id="chatcmpl-42")  # under the app's own OTel span
    raw_client = _served(1, root.span_id, "writer", [6], response_id="chatcmpl-7", end=3_000)  # no LangChain call
    ds = mine_spans(raw_spans([root, call, elsewhere, raw_client]))
    acts = ds.actions.sort_values("order")
    assert [list(x) for x in acts["completion_token_ids"]] == [[4], [6]]
    alone = mine_spans(raw_spans([_served(5, 0, "writer", [1, 2], episode="server-only")]), server_records_only=True)
    assert list(alone.episodes["episode_id"]) == ["server-only"] and list(alone.actions["agent"]) == ["writer"]


def test_calls_without_a_record_are_counted_per_agent(tmp_path):
    root = _root(1, "ep")
    ds, report = mine_with_report(raw_spans([root, _app_call(1, root.span_id, "ep", "drafter")]))
    assert report.actions_without_token_ids == {"drafter": 1} and report.served_merged == 0
